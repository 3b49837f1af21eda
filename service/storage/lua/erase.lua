--[[
erase.lua: remove everything stored about one caller in the caller's slot (Store.erase_caller), atomically,
and leave a tombstone.

KEYS[1]  the caller's memory hash          cm:{<bucket>}:m:<project>:<subject>
KEYS[2]  the bucket's expiry index         cm:{<bucket>}:x
KEYS[3]  the caller's first interaction    cm:{<bucket>}:f:<project>:<subject>
KEYS[4]  the caller's conversation ids     cm:{<bucket>}:cs:<project>:<subject>
KEYS[5]  the caller's tombstone            cm:{<bucket>}:t:<project>:<subject>
ARGV[1]  the caller's member in the expiry index
ARGV[2]  the prefix of the caller's conversation records, "cm:{<bucket>}:c:<project>:" (same slot: the
         records are named from the set's members, which is why they are not in KEYS)
ARGV[3]  erased_at (ms), ARGV[4] when the tombstone expires (ms)

Returns {fields removed, first interaction removed (0/1), conversation id, ...}.
]]
local fields = redis.call('HLEN', KEYS[1])
local first = redis.call('DEL', KEYS[3])
local ids = redis.call('SMEMBERS', KEYS[4])
for _, id in ipairs(ids) do
  redis.call('DEL', ARGV[2] .. id)
end
redis.call('DEL', KEYS[1], KEYS[4])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[5], 'erased_at', ARGV[3], 'expires_at', ARGV[4])
redis.call('PEXPIREAT', KEYS[5], ARGV[4])
local out = {fields, first}
for _, id in ipairs(ids) do
  out[#out + 1] = id
end
return out
