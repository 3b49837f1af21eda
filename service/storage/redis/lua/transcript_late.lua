--[[
transcript_late.lua: a platform's transcript added once to a conversation the service ended
(LateTranscriptStore.add_late_messages), in the conversation's slot.

KEYS[1..3] the header, the messages and their index (as in transcript_append.lua)
ARGV: now_ms, N, then N times: turn_id, message id ("" none), tokens, body.
Returns the transcript's expiry (ms) when added (the service then adds the bytes to the project's
count, transcript_tally.lua), else 0.
]]
local hk, mk, ik = KEYS[1], KEYS[2], KEYS[3]
local now, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local h = {}
local raw = redis.call('HGETALL', hk)
for i = 1, #raw, 2 do
  h[raw[i]] = raw[i + 1]
end
if h.status ~= 'ended' or (h.ended_by ~= 'inactivity' and h.ended_by ~= 'superseded') then
  return 0
end
if tonumber(h.forget_at) <= now or tonumber(h.expires_at) <= now or tonumber(h.messages) ~= 0 or n == 0 then
  return 0
end
local elements, records = {}, {}
local bytes, tokens, turn = 0, 0, -1
for i = 0, n - 1 do
  local at = 3 + i * 4
  local turn_id, mid, body = tonumber(ARGV[at]), ARGV[at + 1], ARGV[at + 3]
  elements[#elements + 1] = mid .. '\n' .. body
  local digest = 0
  if mid ~= '' then
    digest = tonumber(string.sub(redis.sha1hex(mid), 1, 8), 16)
  end
  records[#records + 1] = struct.pack('>dI4', turn_id, digest)
  bytes = bytes + #body
  tokens = tokens + tonumber(ARGV[at + 2])
  if turn_id > turn then
    turn = turn_id
  end
end
for i = 1, #elements, 1000 do -- unpack() is limited by the Lua C stack
  redis.call('RPUSH', mk, unpack(elements, i, math.min(i + 999, #elements)))
end
redis.call('APPEND', ik, table.concat(records))
redis.call('HSET', hk, 'messages', n, 'bytes', bytes, 'tokens', tokens, 'turn_id', turn)
redis.call('PEXPIREAT', mk, h.expires_at)
redis.call('PEXPIREAT', ik, h.expires_at)
return tonumber(h.expires_at)
