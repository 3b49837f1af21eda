--[[
transcript_due.lua: when one conversation of the due index is really due, in its slot (read only;
TranscriptStore.due_conversations).

KEYS[1]  the header (as in transcript_append.lua)
ARGV: now_ms, grace (ms)

Returns its due time (the header's due_at: the inactivity due time while open, the lease's end while ending),
or -1 when it is never due again (no header left, ended, a marker). An open conversation whose transcript
expired cannot be claimed any more (claim_end: missing): it stays due for ``grace`` after its expiry, then is
due again only at its forget_at (by then Redis has dropped the header, and the entry goes; a service whose clock
runs ahead of Redis's finds it due until then).
]]
local now = tonumber(ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'status', 'due_at', 'expires_at', 'forget_at')
if (h[1] ~= 'open' and h[1] ~= 'ending') or not h[2] then
  return -1
end
local due = tonumber(h[2])
local expires, forget = tonumber(h[3]), tonumber(h[4])
if expires + tonumber(ARGV[2]) <= now and due < forget then
  due = forget
end
return due
