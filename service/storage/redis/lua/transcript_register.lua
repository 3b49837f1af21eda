--[[
transcript_register.lua: list a conversation among its caller's, in the caller's slot, before the conversation
is written (TranscriptStore.append_messages): an erasure of the caller finds what is listed here.

KEYS[1]  the caller's conversations   cm:{<bucket>}:vc:<project>:<subject>   zset conv_id -> horizon
KEYS[2]  the caller's tombstone       cm:{<bucket>}:t:<project>:<subject>
KEYS[3..5] the caller's indexes: by start (vs), by channel (vk), across channels (va) (see keys.py)
ARGV: now_ms, made_at (of the append), the conversation id, its horizon (ms: a time no earlier than the
conversation's forget_at; an entry is forgotten, and dropped here, once its horizon passed), and for an append
that creates the conversation its start time and its member among its channel's open ones ("", "" otherwise).

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
-- Forgotten conversations leave the listing and the indexes keyed by id (those keyed by channel are checked
-- against the header when read, and expire with the listing).
local gone = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE')
for i = 1, #gone, 1000 do
  local part = {unpack(gone, i, math.min(i + 999, #gone))}
  redis.call('ZREM', KEYS[1], unpack(part))
  redis.call('ZREM', KEYS[3], unpack(part))
  redis.call('ZREM', KEYS[5], unpack(part))
end
redis.call('ZADD', KEYS[1], 'GT', ARGV[4], ARGV[3])
if ARGV[5] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[5], ARGV[3])
  redis.call('ZADD', KEYS[4], 0, ARGV[6])
  redis.call('ZADD', KEYS[5], 9007199254740991, ARGV[3])
end
local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
for k = 1, 5 do
  if k ~= 2 then
    redis.call('PEXPIREAT', KEYS[k], top[2])
  end
end
return {1, prior}
