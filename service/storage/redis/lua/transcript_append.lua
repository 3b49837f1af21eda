--[[
transcript_append.lua: append a batch of messages and/or keep a state checkpoint, atomically, in the
conversation's slot (TranscriptStore.append_messages). Redis 7.0+.

KEYS[1]  the header           cm:{<vbucket>}:vh:<project>:<conv_id>   (fields: see redis_transcripts.py)
KEYS[2]  the messages         cm:{<vbucket>}:vm:<project>:<conv_id>   list of "<message id>\n<body>"
KEYS[3]  their index          cm:{<vbucket>}:vi:<project>:<conv_id>   string, 12 bytes per message: its turn
                                                                     id (big-endian double) and the first 4
                                                                     bytes of sha1(message id) (0 for none)
KEYS[4]  checkpoint, summary  cm:{<vbucket>}:vd:<project>:<conv_id>
KEYS[5]  (standalone server only) the project's bytes by hour, cm:{a:<project>}:vb, another slot: on a
         cluster the service adds the bytes itself after this script (transcript_tally.lua)
KEYS[6..8] (standalone server only, with a horizon of "@<due member>") the caller's conversations, the
         caller's tombstone and the due index, and KEYS[9..11] the caller's indexes (vs, vk, va: keys.py):
         the listing of transcript_register.lua is done here, in the same step (on a cluster those keys are
         in other slots: the service runs that script first)

ARGV: now_ms, create ("1", "2" when the caller is of another project than the conversation, or ""), horizon ("" unless the service just listed the conversation among its
caller's, transcript_register.lua: then the score it wrote; "@<due member>" on a standalone server: list it
here if needed, with KEYS[6..8]), the caller's erasure before that listing
("<erased_at>|<until>" or ""), subject, channel, agent, made_at, expires_at, forget_at, due_at,
max_messages, max_bytes, checkpoint ("" none, or "=" and the encoded checkpoint), the bytes tally
("<hour start>|<prune before>" with KEYS[5], else ""), N, the caller's region (kept by a creating append),
the conversation's member among its channel's open ones (with a horizon of "@..."), then N times: turn_id,
message id ("" none or "=" and the id), tokens, body.

Returns {status, detail, added, added bytes, due, header (HGETALL, flat; empty when there is none), {checkpoint,
summary}, alone}; alone is 1 when this append listed a conversation it created and the caller has no other
listed (nothing to supersede), else 0. status is an AppendStatus value, or "register": nothing was written, the service must first list
the conversation among its caller's (detail: the subject), for a conversation this append creates or one
whose forget_at would pass the listing's horizon; it then runs the script again with the horizon. due is the
new due time when it moved earlier than the header's (the service moves the due index: ZADD LT), else "".
]]
local hk, mk, ik, dk = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = tonumber(ARGV[1])
local create = ARGV[2] ~= ''
local horizon = ARGV[3]
local subject = ARGV[5]
local made_at = tonumber(ARGV[8])
local expires_at, forget_at, due_at = ARGV[9], ARGV[10], ARGV[11]
local checkpoint = ARGV[14]
local n = tonumber(ARGV[16])

-- The first 4 bytes of a message id's SHA-1, as a number: what the index keeps of it.
local function digest(id)
  return tonumber(string.sub(redis.sha1hex(id), 1, 8), 16)
end

local alone = 0

local function reply(status, detail, added, added_bytes, due, with_header)
  local flat, data = {}, {}
  if with_header then
    flat = redis.call('HGETALL', hk)
    data = redis.call('HMGET', dk, 'checkpoint', 'summary')
  end
  return {status, detail or '', added or 0, added_bytes or 0, due or '', flat, data, alone}
end

local h = {}
local raw = redis.call('HGETALL', hk)
for i = 1, #raw, 2 do
  h[raw[i]] = raw[i + 1]
end
-- Remembered by the service's clock (Redis's may lag behind it and not have dropped it yet).
local exists = h.status ~= nil and tonumber(h.forget_at) > now
if exists then
  if h.status == 'erased' or h.status == 'deleted' then
    return reply('erased', nil, 0, 0, nil, true)
  end
  if create and (h.subject ~= subject or ARGV[2] == '2') then
    return reply('other_caller', nil, 0, 0, nil, true)
  end
  -- Started after its caller's erasure: it takes nothing made before that erasure (an outbox's retry).
  if h.prior_erased_at and tonumber(h.prior_erased_until) > now and tonumber(h.prior_erased_at) >= made_at then
    return reply('erased', nil, 0, 0, nil, true)
  end
  if tonumber(h.expires_at) <= now then
    return reply('expired', nil, 0, 0, nil, true)
  end
  if h.status ~= 'open' then
    return reply('ended', nil, 0, 0, nil, true)
  end
elseif not create then
  return reply('not_found')
end

-- Message ids: the same id with the same body is already there (skipped), with another body a conflict.
local count = exists and tonumber(h.messages) or 0
if exists and n > 0 and redis.call('LLEN', mk) ~= count then
  -- Redis expired the transcript by its own clock, ahead of the service's: it is gone all the same.
  return reply('expired', nil, 0, 0, nil, true)
end
local index = nil
-- The body stored under message id ``mid``, or nil. The index is scanned for the id's digest (at a record's
-- digest offset), and a match is confirmed by the id stored with the message.
local function stored_body(mid)
  if index == nil then
    index = redis.call('GET', ik) or ''
  end
  local wanted = struct.pack('>I4', digest(mid))
  local from = 1
  while true do
    local pos = string.find(index, wanted, from, true)
    if not pos then
      return nil
    end
    if (pos - 1) % 12 == 8 then
      local element = redis.call('LINDEX', mk, (pos - 9) / 12)
      if element then
        local cut = string.find(element, '\n', 1, true)
        if string.sub(element, 1, cut - 1) == mid then
          return string.sub(element, cut + 1)
        end
      end
    end
    from = pos + 1
  end
end
local new = {}
local in_batch = {}
for i = 0, n - 1 do
  local at = 19 + 4 * i
  local id, body = ARGV[at + 1], ARGV[at + 3]
  local fresh = true
  if id ~= '' then
    local mid = string.sub(id, 2)
    local prior = in_batch[mid]
    if prior == nil and exists then
      prior = stored_body(mid)
    end
    if prior ~= nil then
      if prior ~= body then
        return reply('id_conflict', mid, 0, 0, nil, exists)
      end
      fresh = false
    else
      in_batch[mid] = body
    end
  end
  if fresh then
    new[#new + 1] = at
  end
end

local turn = exists and tonumber(h.turn_id) or -1
for _, at in ipairs(new) do
  local t = tonumber(ARGV[at])
  if t < turn then
    return reply('turn_order', ARGV[at], 0, 0, nil, exists)
  end
  turn = t
end

local added_bytes, added_tokens = 0, 0
for _, at in ipairs(new) do
  added_bytes = added_bytes + #ARGV[at + 3]
  added_tokens = added_tokens + tonumber(ARGV[at + 2])
end
if #new > 0 then
  if count + #new > tonumber(ARGV[12]) then
    return reply('too_many_messages', nil, 0, 0, nil, exists)
  end
  if (exists and tonumber(h.bytes) or 0) + added_bytes > tonumber(ARGV[13]) then
    return reply('too_many_bytes', nil, 0, 0, nil, exists)
  end
end
-- A checkpoint made before the kept one (an outbox delivering late) does not replace it.
local keep = checkpoint ~= '' and (not exists or tonumber(h.checkpoint_at) <= made_at)
if exists and #new == 0 and not keep then
  return reply('appended', nil, 0, 0, nil, true) -- a retry: not even activity
end

-- Listed among the caller's conversations before anything of it is written, for as long as it is remembered:
-- an erasure that runs in between finds it and leaves the marker this script then sees.
local prior = ARGV[4]
if string.sub(horizon, 1, 1) == '@' then
  -- A standalone server: what transcript_register.lua does, here (every key is on this server).
  local due_member = string.sub(horizon, 2)
  horizon = ''
  -- Only an append that names its caller comes here (create): an existing conversation is that caller's.
  if not exists or tonumber(forget_at) > tonumber(h.horizon) then
    local lk, tk = KEYS[6], KEYS[7]
    local tomb = redis.call('HMGET', tk, 'erased_at', 'expires_at')
    if tomb[1] and tonumber(tomb[2]) > now then
      if tonumber(tomb[1]) >= made_at then
        return reply('erased', nil, 0, 0, nil, exists)
      end
      prior = tomb[1] .. '|' .. tomb[2]
    end
    local f = tonumber(forget_at)
    horizon = tostring(f + math.max(0, f - now))
    local id = string.match(hk, ':vh:[^:]+:(.*)$')
    local gone = redis.call('ZRANGE', lk, '-inf', now, 'BYSCORE')
    for i = 1, #gone, 1000 do
      local part = {unpack(gone, i, math.min(i + 999, #gone))}
      redis.call('ZREM', lk, unpack(part))
      redis.call('ZREM', KEYS[9], unpack(part))
      redis.call('ZREM', KEYS[11], unpack(part))
    end
    redis.call('ZADD', lk, 'GT', horizon, id)
    if not exists then
      redis.call('ZADD', KEYS[9], now, id)
      redis.call('ZADD', KEYS[10], 0, ARGV[18])
      redis.call('ZADD', KEYS[11], 9007199254740991, id)
    end
    local top = redis.call('ZRANGE', lk, -1, -1, 'WITHSCORES')
    for _, k in ipairs({lk, KEYS[9], KEYS[10], KEYS[11]}) do
      redis.call('PEXPIREAT', k, top[2])
    end
    if not exists then
      redis.call('ZADD', KEYS[8], due_at, due_member)
      if redis.call('ZCARD', lk) == 1 then
        alone = 1
      end
    end
  else
    horizon = h.horizon  -- listed for long enough already
  end
end

if horizon == '' then
  if not exists then
    return reply('register', subject)
  end
  if tonumber(forget_at) > tonumber(h.horizon) then
    return reply('register', h.subject, 0, 0, nil, true)
  end
end

if not exists then
  redis.call('DEL', hk, mk, ik, dk) -- what is left of a forgotten conversation of this id
  redis.call('HSET', hk, 'status', 'open', 'subject', subject, 'channel', ARGV[6], 'agent', ARGV[7],
    'started_at', now, 'messages', 0, 'bytes', 0, 'tokens', 0, 'checkpoint_at', 0, 'ended_by', '',
    'end_reason', '', 'ended_at', 0, 'lease_until', 0, 'end_data', '', 'horizon', horizon, 'region', ARGV[17])
  local erased_at, erased_until = string.match(prior, '^(%d+)|(%d+)$')
  if erased_at then
    redis.call('HSET', hk, 'prior_erased_at', erased_at, 'prior_erased_until', erased_until)
  end
  h = {bytes = '0', tokens = '0'}
elseif horizon ~= '' and tonumber(horizon) > tonumber(h.horizon) then
  redis.call('HSET', hk, 'horizon', horizon)
end

if #new > 0 then
  local elements, records = {}, {}
  for _, at in ipairs(new) do
    local mid = string.sub(ARGV[at + 1], 2)
    elements[#elements + 1] = mid .. '\n' .. ARGV[at + 3]
    records[#records + 1] = struct.pack('>dI4', tonumber(ARGV[at]), mid == '' and 0 or digest(mid))
  end
  for i = 1, #elements, 1000 do -- unpack() is limited by the Lua C stack
    redis.call('RPUSH', mk, unpack(elements, i, math.min(i + 999, #elements)))
  end
  redis.call('APPEND', ik, table.concat(records))
end
redis.call('HSET', hk, 'last_activity', now, 'turn_id', turn, 'messages', count + #new,
  'bytes', tonumber(h.bytes) + added_bytes, 'tokens', tonumber(h.tokens) + added_tokens,
  'expires_at', expires_at, 'forget_at', forget_at, 'due_at', due_at)
if keep then
  redis.call('HSET', dk, 'checkpoint', string.sub(checkpoint, 2))
  redis.call('HSET', hk, 'checkpoint_at', made_at)
end
-- The transcript dies at its expiry and the header at its forget time even if nothing else runs.
redis.call('PEXPIREAT', mk, expires_at)
redis.call('PEXPIREAT', ik, expires_at)
redis.call('PEXPIREAT', dk, expires_at)
redis.call('PEXPIREAT', hk, forget_at)

if ARGV[15] ~= '' and added_bytes > 0 then
  -- As transcript_tally.lua does on a cluster (a standalone server takes any key).
  local hour, prune = string.match(ARGV[15], '^(%d+)|(%-?%d+)$')
  local fresh = redis.call('HEXISTS', KEYS[5], hour) == 0
  redis.call('HINCRBY', KEYS[5], hour, added_bytes)
  if fresh then
    for _, start in ipairs(redis.call('HKEYS', KEYS[5])) do
      if tonumber(start) < tonumber(prune) then
        redis.call('HDEL', KEYS[5], start)
      end
    end
  end
  if redis.call('PEXPIRETIME', KEYS[5]) < tonumber(expires_at) then
    redis.call('PEXPIREAT', KEYS[5], expires_at)
  end
end

local due = ''
if exists and tonumber(due_at) < tonumber(h.due_at) then
  due = due_at
end
return reply('appended', nil, #new, added_bytes, due, true)
