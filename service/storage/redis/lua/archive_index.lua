--[[
archive_index.lua: list an archived object among its caller's (ArchiveStore.list_archived), in the caller's
slot, before the object is written: an erasure of the caller finds what is listed here.

KEYS[1]  the caller's archived objects   cm:{<bucket>}:va:<project>:<subject>   zset object key -> expires_at
KEYS[2]  the caller's tombstone          cm:{<bucket>}:t:<project>:<subject>
ARGV: now_ms, made_at (of the end that archives it), the object key, its expires_at.

Returns 0 without listing anything when the caller was erased at or after made_at (a live tombstone), else 1.
]]
local now = tonumber(ARGV[1])
local tomb = redis.call('HMGET', KEYS[2], 'erased_at', 'expires_at')
if tomb[1] and tonumber(tomb[2]) > now and tonumber(tomb[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], 'GT', ARGV[4], ARGV[3])
local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], top[2])
return 1
