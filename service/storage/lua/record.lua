--[[
record.lua: add an ended conversation to a project's analytics, once (Store.record_conversation).

KEYS[1]  the listed entry              cm:{a:<project>}:e:<conversation_id>
KEYS[2]  the index of all entries      cm:{a:<project>}:i:all
KEYS[3]  the index of its kind         cm:{a:<project>}:i:repeat or :i:first
KEYS[4..] the counter hashes of its hour, day and week   cm:{a:<project>}:k:<kind>:<start>
(all in one slot: the {a:<project>} hash tag)

ARGV: value ("<expires_at>|<recorded_at>|<json>"; entries of earlier releases are "<expires_at>|<json>"), sort
key, expires_at, recorded_at (ms), then for each counter hash (in KEYS order) the number N of its increments
followed by N pairs of counter name and increment. A counter hash keeps "_expires_at" and "_recorded_at", the
latest of its conversations' (so that a retention shortened since can be applied to the bucket).
Returns 1 if recorded, 0 if the conversation was already recorded (nothing changes then).
]]

if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local expires_at = ARGV[3]
local recorded_at = tonumber(ARGV[4])
redis.call('SET', KEYS[1], ARGV[1], 'PXAT', expires_at)
redis.call('ZADD', KEYS[2], 0, ARGV[2])
redis.call('ZADD', KEYS[3], 0, ARGV[2])
local pos = 5
for k = 4, #KEYS do
  local n = tonumber(ARGV[pos])
  for i = pos + 1, pos + 2 * n, 2 do
    redis.call('HINCRBY', KEYS[k], ARGV[i], ARGV[i + 1])
  end
  pos = pos + 1 + 2 * n
  -- A bucket lives as long as its latest conversation.
  local current = tonumber(redis.call('HGET', KEYS[k], '_expires_at') or '0')
  if tonumber(expires_at) > current then
    redis.call('HSET', KEYS[k], '_expires_at', expires_at)
    redis.call('PEXPIREAT', KEYS[k], expires_at)
  end
  if recorded_at > tonumber(redis.call('HGET', KEYS[k], '_recorded_at') or '0') then
    redis.call('HSET', KEYS[k], '_recorded_at', recorded_at)
  end
end
return 1
