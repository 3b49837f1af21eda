--[[
transcript_remove.lua: delete a conversation's transcript (messages, ids, checkpoint, summary) and leave a
marker header in its place, in the conversation's slot (TranscriptStore.delete_conversation; and for each
conversation of an erased caller, Store.erase_caller).

KEYS[1..4]  header, messages, message ids, checkpoint and summary (as in transcript_append.lua)
ARGV: now_ms, the marker's status ("deleted" or "erased"), the subject it must belong to ("" any), and for an
erasure the horizon of the caller's listing ("" none).

A marker keeps status, expires_at and forget_at only, and lives until the header would have. An erasure of a
conversation that is listed but not written (an append listed it and has not run yet, or never will) leaves
a marker until the horizon: that append then finds it. Another caller's conversation, or a marker, is left
alone.

Returns {"removed", header as it was (HGETALL, flat), {checkpoint, summary}} or {"", {}, {}}.
]]
local hk, mk, ik, dk = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = tonumber(ARGV[1])
local h = {}
local raw = redis.call('HGETALL', hk)
for i = 1, #raw, 2 do
  h[raw[i]] = raw[i + 1]
end
if not h.status or tonumber(h.forget_at) <= now then
  if ARGV[2] == 'erased' and ARGV[4] ~= '' and tonumber(ARGV[4]) > now then
    redis.call('DEL', hk, mk, ik, dk)
    redis.call('HSET', hk, 'status', 'erased', 'expires_at', now, 'forget_at', ARGV[4])
    redis.call('PEXPIREAT', hk, ARGV[4])
  end
  return {'', {}, {}}
end
if h.status == 'erased' or h.status == 'deleted' or (ARGV[3] ~= '' and h.subject ~= ARGV[3]) then
  return {'', {}, {}}
end
local data = redis.call('HMGET', dk, 'checkpoint', 'summary')
redis.call('DEL', hk, mk, ik, dk)
redis.call('HSET', hk, 'status', ARGV[2], 'expires_at', h.expires_at, 'forget_at', h.forget_at)
redis.call('PEXPIREAT', hk, h.forget_at)
return {'removed', raw, data}
