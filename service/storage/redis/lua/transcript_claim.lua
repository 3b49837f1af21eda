--[[
transcript_claim.lua: take a conversation from open to ending for one end, or take over an ending one whose
lease lapsed (TranscriptStore.claim_end), in the conversation's slot.

KEYS[1]  the header, KEYS[2] its checkpoint and summary (as in transcript_append.lua)
ARGV: now_ms, ended_by, end_reason, idle_since ("" none), lease_until, end_data

Returns {status, header (HGETALL, flat), {checkpoint, summary}}; status a ClaimStatus value. The header's due_at
becomes lease_until (the service moves the due index after it). For "missing" the header is there only when the
transcript expired (it can never be claimed again).
]]
local now = tonumber(ARGV[1])
local h = {}
local raw = redis.call('HGETALL', KEYS[1])
for i = 1, #raw, 2 do
  h[raw[i]] = raw[i + 1]
end
local function reply(status)
  return {status, redis.call('HGETALL', KEYS[1]), redis.call('HMGET', KEYS[2], 'checkpoint', 'summary')}
end
if not h.status or tonumber(h.forget_at) <= now or h.status == 'erased' or h.status == 'deleted' then
  return {'missing', {}, {}}
end
if tonumber(h.expires_at) <= now then
  return {'missing', raw, {}} -- expired: nothing can claim it any more (the service drops its due entry)
end
if h.status == 'ended' or (h.status == 'ending' and tonumber(h.lease_until) > now) then
  return reply('already')
end
if h.status == 'open' and ARGV[4] ~= '' and tonumber(h.last_activity) > tonumber(ARGV[4]) then
  return reply('not_due')
end
local ended_at = now
if h.status == 'ending' then
  ended_at = h.ended_at -- a take-over: the first claim's time stays
end
redis.call('HSET', KEYS[1], 'status', 'ending', 'ended_by', ARGV[2], 'end_reason', ARGV[3], 'end_data', ARGV[6],
  'lease_until', ARGV[5], 'ended_at', ended_at, 'due_at', ARGV[5])
return reply('claimed')
