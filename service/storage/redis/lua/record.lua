--[[
record.lua: add an ended conversation to a project's analytics, once (Store.record_conversation).

KEYS[1]  the listed entry              cm:{a:<project>}:e:<conversation_id>
KEYS[2]  the index of all entries      cm:{a:<project>}:i:all
KEYS[3]  the index of its kind         cm:{a:<project>}:i:repeat or :i:first
KEYS[4]  (standalone server only) the caller's tombstone, cm:{<bucket>}:t:<project>:<subject>, another slot: on
         a cluster the service reads it itself after this script
KEYS[4..] (KEYS[5..] with the tombstone) the counter hashes of its hour, day and week
         cm:{a:<project>}:k:<kind>:<start>
(all but the tombstone in one slot: the {a:<project>} hash tag)

ARGV: value ("<expires_at>|<recorded_at>|<json>"; entries of earlier releases are "<expires_at>|<json>"), sort
key, expires_at, recorded_at (ms), made_at (ms: when the end of the conversation was made; "" when KEYS holds
no tombstone), now_ms (the service's clock), then for each counter hash (in KEYS order) the number N of its
increments followed by N pairs of counter name and increment. A counter hash keeps "_expires_at" and
"_recorded_at", the latest of its conversations' (so that a retention shortened since can be applied to the
bucket).
Returns 1 if recorded, 0 if the conversation was already recorded (nothing changes then), 2 if the caller
was erased at or after made_at (a live tombstone): the conversation is not listed (a listing of it is
removed), and counted unless it was already (counters are anonymous: an erasure leaves them).
]]

local erased = false
local first_counter = 4
if ARGV[5] ~= '' then
  first_counter = 5
  local tomb = redis.call('HMGET', KEYS[4], 'erased_at', 'expires_at')
  if tomb[1] and tonumber(tomb[2]) > tonumber(ARGV[6]) and tonumber(tomb[1]) >= tonumber(ARGV[5]) then
    erased = true
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  if erased then
    -- The same conversation id: the same sort key (its hour is the one its end first found).
    redis.call('ZREM', KEYS[2], ARGV[2])
    redis.call('ZREM', KEYS[3], ARGV[2])
    redis.call('DEL', KEYS[1])
    return 2
  end
  return 0
end
local expires_at = ARGV[3]
local recorded_at = tonumber(ARGV[4])
local pos = 7
for k = first_counter, #KEYS do
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
if erased then
  return 2
end
redis.call('SET', KEYS[1], ARGV[1], 'PXAT', expires_at)
redis.call('ZADD', KEYS[2], 0, ARGV[2])
redis.call('ZADD', KEYS[3], 0, ARGV[2])
return 1
