--[[
erase.lua: remove everything stored about one caller (Store.erase_caller), atomically.

KEYS[1]  the caller's memory hash, KEYS[2] the bucket's expiry index, KEYS[3] the caller's first-interaction
record (all in one slot).
ARGV[1]  the caller's member in the expiry index.
Returns the number of fields removed (live or dead).
]]
local removed = redis.call('HLEN', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[3])
redis.call('ZREM', KEYS[2], ARGV[1])
return removed
