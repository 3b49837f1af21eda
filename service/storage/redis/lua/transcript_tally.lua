--[[
transcript_tally.lua: add bytes to (or take them from) a project's count of appended transcript bytes, by
hour, in the project's slot (TranscriptStore.transcript_bytes; on a standalone server an append does it inside
transcript_append.lua).

KEYS[1]  the project's bytes by hour   cm:{a:<project>}:vb   hash hour start -> bytes
ARGV: hour start, bytes (negative to take off: nothing then if that hour is no longer counted), hours before
this one are dropped when a new hour starts, expires_at (when the hash may go, for additions)
]]
local hour, delta = ARGV[1], tonumber(ARGV[2])
local fresh = redis.call('HEXISTS', KEYS[1], hour) == 0
if fresh and delta < 0 then
  return 0
end
redis.call('HINCRBY', KEYS[1], hour, delta)
if fresh then
  for _, start in ipairs(redis.call('HKEYS', KEYS[1])) do
    if tonumber(start) < tonumber(ARGV[3]) then
      redis.call('HDEL', KEYS[1], start)
    end
  end
end
if delta > 0 and redis.call('PEXPIRETIME', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('PEXPIREAT', KEYS[1], ARGV[4])
end
return 1
