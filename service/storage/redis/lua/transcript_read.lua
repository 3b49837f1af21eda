--[[
transcript_read.lua: a conversation's header and, optionally, some of its messages, in one atomic read in its
slot (TranscriptStore.read_conversation). Writes nothing.

KEYS[1..4]  header, messages, their index, checkpoint and summary (as in transcript_append.lua)
ARGV: now_ms, then "" for the header alone, or "M" followed by after_turn, last and limit (each "" for none)

Messages are those whose turn id is above after_turn (found by a binary search of the index: turn ids never
decrease), of those only the last ``last``, and of those at most ``limit``, in order.

Returns {header (HGETALL, flat), {checkpoint, summary}, position of the first message, their index records
(12 bytes each), their elements ("<message id>\n<body>")}; no messages for a header that is forgotten, a marker
or expired by the service's clock.
]]
local hk, mk, ik, dk = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = tonumber(ARGV[1])
local raw = redis.call('HGETALL', hk)
local data = redis.call('HMGET', dk, 'checkpoint', 'summary')
local h = {}
for i = 1, #raw, 2 do
  h[raw[i]] = raw[i + 1]
end
if ARGV[2] ~= 'M' or not h.status or h.status == 'erased' or h.status == 'deleted'
    or tonumber(h.forget_at) <= now or tonumber(h.expires_at) <= now then
  return {raw, data, 0, '', {}}
end
local n = math.min(tonumber(h.messages), redis.call('LLEN', mk), math.floor(redis.call('STRLEN', ik) / 12))
local first, last = 0, n - 1
if ARGV[3] ~= '' then
  local after = tonumber(ARGV[3])
  local low, high = 0, n
  while low < high do
    local middle = math.floor((low + high) / 2)
    local turn = struct.unpack('>d', redis.call('GETRANGE', ik, middle * 12, middle * 12 + 7))
    if turn > after then
      high = middle
    else
      low = middle + 1
    end
  end
  first = low
end
if ARGV[4] ~= '' then
  first = math.max(first, n - tonumber(ARGV[4]))
end
if ARGV[5] ~= '' then
  last = math.min(last, first + tonumber(ARGV[5]) - 1)
end
if first > last then
  return {raw, data, first, '', {}}
end
return {raw, data, first, redis.call('GETRANGE', ik, first * 12, last * 12 + 11), redis.call('LRANGE', mk, first, last)}
