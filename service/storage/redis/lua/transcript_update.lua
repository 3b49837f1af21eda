--[[
transcript_update.lua: the small writes to one conversation's header, in its slot: finish an end, keep a
summary, move the due time (TranscriptStore.finish_end, put_summary, reschedule).

KEYS[1]  the header, KEYS[2] its checkpoint and summary (as in transcript_append.lua)
ARGV: the operation, now_ms, then
  "finish"                   ending -> ended (an ended one stays as it is)
  "summary", the summary     kept while the transcript lives (any status but a marker); not activity
  "due", due_at              for an open or ending conversation (now_ms is not looked at)

Returns {result, header (HGETALL, flat), {checkpoint, summary}}; result "" when there is nothing to update
(no such conversation, forgotten, a marker; for a summary an expired transcript too; for "due" anything but
open or ending), "changed" or "same".
]]
local op, now = ARGV[1], tonumber(ARGV[2])
local h = {}
local raw = redis.call('HGETALL', KEYS[1])
for i = 1, #raw, 2 do
  h[raw[i]] = raw[i + 1]
end
local function reply(result)
  return {result, redis.call('HGETALL', KEYS[1]), redis.call('HMGET', KEYS[2], 'checkpoint', 'summary')}
end
if op == 'due' then
  if h.status ~= 'open' and h.status ~= 'ending' then
    return {'', {}, {}}
  end
  redis.call('HSET', KEYS[1], 'due_at', ARGV[3])
  return {'changed', {}, {}}
end
if not h.status or tonumber(h.forget_at) <= now or h.status == 'erased' or h.status == 'deleted' then
  return {'', {}, {}}
end
if op == 'finish' then
  if h.status ~= 'ending' then
    return reply('same')
  end
  redis.call('HSET', KEYS[1], 'status', 'ended')
  return reply('changed')
end
if tonumber(h.expires_at) <= now then
  return {'', {}, {}}
end
redis.call('HSET', KEYS[2], 'summary', ARGV[3])
redis.call('PEXPIREAT', KEYS[2], h.expires_at)
return reply('changed')
