--[[
transcript_register.lua: list a conversation among its caller's, in the caller's slot, before the conversation
is written (TranscriptStore.append_messages): an erasure of the caller finds what is listed here.

KEYS[1]  the caller's conversations   cm:{<bucket>}:vc:<project>:<subject>   zset conv_id -> horizon
KEYS[2]  the caller's tombstone       cm:{<bucket>}:t:<project>:<subject>
ARGV: now_ms, made_at (of the append), the conversation id, its horizon (ms: a time no earlier than the
conversation's forget_at; an entry is forgotten, and dropped here, once its horizon passed).

Returns {0, ""} without listing anything when the caller was erased at or after made_at (a live tombstone),
else {1, "<erased_at>|<tombstone expires_at>" of an earlier erasure still remembered, or ""}.
]]
local now = tonumber(ARGV[1])
local tomb = redis.call('HMGET', KEYS[2], 'erased_at', 'expires_at')
local prior = ''
if tomb[1] and tonumber(tomb[2]) > now then
  if tonumber(tomb[1]) >= tonumber(ARGV[2]) then
    return {0, ''}
  end
  prior = tomb[1] .. '|' .. tomb[2]
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], 'GT', ARGV[4], ARGV[3])
local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], top[2])
return {1, prior}
