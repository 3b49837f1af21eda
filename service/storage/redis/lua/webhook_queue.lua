--[[
webhook_queue.lua: one endpoint's delivery queue (WebhookStore), every key in the endpoint's slot.

KEYS[1]  due       cm:{wq:<project>:<endpoint_id>}:q   zset  queued deliveries not leased, by next_attempt_at
KEYS[2]  leased    ...:l                               zset  queued deliveries under a lease, by lease_until
KEYS[3]  failed    ...:f                               zset  failed deliveries, by minus last_attempt_at
                                                             (most recent first, then delivery id)
KEYS[4]  expiry    ...:x                               zset  every delivery of the endpoint, by expires_at
KEYS[5]  created   ...:o                               zset  queued deliveries (leased or not), by created_at
         delivered ...:v (named from KEYS[1], not passed: same slot)
                                                       zset  delivered deliveries, by minus last_attempt_at
ARGV[1]  now_ms; ARGV[2] the prefix of the delivery hashes, "cm:{wq:<project>:<endpoint_id>}:d:" (same slot:
         they are named from the sets' members, which is why they are not in KEYS); ARGV[3] the operation,
         then its arguments:
  claim      limit, owner, lease_until: leases due deliveries, earliest due first (then id). Returns them.
  settle     delivery id, owner, outcome (delivered | retry | failed), next_attempt_at, error, the HTTP
             status (0: none), until when a delivered one is kept at most, the error as the attempt keeps it
             (one line, cut short), how many delivered ones the endpoint keeps at most. Records the attempt
             among the kept ones; a delivered one loses its payload and is kept, listed in `delivered` (the
             oldest delivered ones beyond the bound are deleted). Returns
             {1, subject} when recorded; {0, ""} when the delivery is gone or not leased by owner.
  redeliver  delivery id: a failed delivery queued again, due now, attempts 0. Returns it; a queued one as it
             is; {} if none (or delivered).
  remove     subject ("" for any), then delivery ids: deletes those about that subject. Returns the
             triples of id, subject and status of what it deleted.
  drop       how many: deletes that many of the endpoint's deliveries (its deletion, batch after batch).
             Returns their ids.
  list       state (queued | failed | delivered), limit: the live deliveries in that state, queued ones
             oldest first, the others most recent attempt first. Returns them.
  stats      Returns {queued, failed, the oldest queued one's created_at or -1}.
A delivery is returned as {id, its hash as a flat list}. Deliveries are written by webhook_enqueue.lua (its
queue part, which keeps to this layout).

A delivery is a hash: event, payload, subject, created_at, expires_at, status (queued | failed | delivered),
attempts, next_attempt_at, last_attempt_at, last_error, attempt_log (the latest KEEP attempts, a line each of
number, time, HTTP status and error split by tabs; absent in a hash written before attempts were kept) and,
while a worker holds it, lease_owner. Its due time is its
score in `due`; under a lease, it is in `leased` instead, scored by the lease's end, so that a claim is one
ZRANGE BYSCORE of `due` after the leases that ran out went back there at their own due time. Each call first
deletes a bounded batch of expired deliveries (by the service's clock; Redis expires their hashes itself at
expires_at, and an index entry whose hash is gone is dropped where it is met). The hash expires (PEXPIREAT) at
its expires_at, the sets at the latest expires_at they hold, so nothing outlives its deliveries.
]]
local due, leased, failed, expiry, created = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local delivered = string.sub(due, 1, -2) .. 'v'
local now = tonumber(ARGV[1])
local prefix, op = ARGV[2], ARGV[3]
-- Expired deliveries deleted per call, and leases that ran out moved back per claim: bounded, so that a call
-- stays short whatever piled up (the rest goes at the next calls).
local PURGE = 200
local RELEASE = 1000
-- Rounds of a claim or a listing that replace candidates found gone (expired by Redis before the service).
local ROUNDS = 4
-- Attempts a delivery keeps (WebhookStore's KEPT_ATTEMPTS).
local KEEP = 10

local function unlist(id)
  redis.call('ZREM', due, id)
  redis.call('ZREM', leased, id)
  redis.call('ZREM', failed, id)
  redis.call('ZREM', expiry, id)
  redis.call('ZREM', created, id)
  redis.call('ZREM', delivered, id)
end

local function drop(id)
  redis.call('DEL', prefix .. id)
  unlist(id)
end

local function purge()
  for _, id in ipairs(redis.call('ZRANGE', expiry, '-inf', now, 'BYSCORE', 'LIMIT', 0, PURGE)) do
    drop(id)
  end
end

local function field(fields, name)
  for i = 1, #fields, 2 do
    if fields[i] == name then
      return fields[i + 1]
    end
  end
  return nil
end

-- The delivery's hash (flat) if it lives; one that is gone, or expired, is dropped (nil).
local function live(id)
  local fields = redis.call('HGETALL', prefix .. id)
  if #fields == 0 then
    unlist(id)
    return nil
  end
  if tonumber(field(fields, 'expires_at') or 0) <= now then
    drop(id)
    return nil
  end
  return fields
end

-- Every key lives until the latest expiry of what it holds (a set created by this call too).
local function extend()
  local top = redis.call('ZRANGE', expiry, -1, -1, 'WITHSCORES')
  if top[2] then
    for i = 1, 5 do
      redis.call('PEXPIREAT', KEYS[i], top[2])
    end
    redis.call('PEXPIREAT', delivered, top[2])
  end
end

if op == 'claim' then
  local limit, owner, lease_until = tonumber(ARGV[4]), ARGV[5], ARGV[6]
  purge()
  -- Leases that ran out: due again at their own due time, so that the claim below takes them in due order.
  for _, id in ipairs(redis.call('ZRANGE', leased, '-inf', now, 'BYSCORE', 'LIMIT', 0, RELEASE)) do
    local at = redis.call('HGET', prefix .. id, 'next_attempt_at')
    redis.call('ZREM', leased, id)
    if at then
      redis.call('ZADD', due, at, id)
    else
      unlist(id)
    end
  end
  local out = {}
  for _ = 1, ROUNDS do
    local want = limit - #out
    if want <= 0 then
      break
    end
    local ids = redis.call('ZRANGE', due, '-inf', now, 'BYSCORE', 'LIMIT', 0, want)
    if #ids == 0 then
      break
    end
    for _, id in ipairs(ids) do
      local fields = live(id)
      if fields then
        redis.call('HSET', prefix .. id, 'lease_owner', owner)
        redis.call('ZREM', due, id)
        redis.call('ZADD', leased, lease_until, id)
        out[#out + 1] = {id, fields}
      end
    end
  end
  extend()
  return out
end

-- The kept attempts with this one added (the oldest dropped beyond KEEP).
local function logged(log, number, status, err)
  local lines = {}
  for line in string.gmatch(log or '', '[^\n]+') do
    lines[#lines + 1] = line
  end
  lines[#lines + 1] = number .. '\t' .. now .. '\t' .. status .. '\t' .. (string.gsub(err, '[\t\n]', ' '))
  return table.concat(lines, '\n', math.max(1, #lines - KEEP + 1))
end

if op == 'settle' then
  local id, owner, outcome = ARGV[4], ARGV[5], ARGV[6]
  local key = prefix .. id
  local d = redis.call('HMGET', key, 'status', 'lease_owner', 'expires_at', 'subject', 'attempts', 'attempt_log')
  if not d[1] then
    unlist(id)
    return {0, ''}
  end
  if tonumber(d[3]) <= now then
    drop(id)
    return {0, ''}
  end
  -- A lease that ran out still counts while nobody else claimed the delivery: the attempt was made, and its
  -- outcome is the latest there is (refusing it would only send the delivery once more).
  if d[1] ~= 'queued' or d[2] ~= owner then
    return {0, ''}
  end
  local number = tonumber(d[5]) + 1
  local log = logged(d[6], number, ARGV[9], ARGV[11])
  if outcome == 'delivered' then
    -- Kept without its payload (it may hold a transcript), for the listing, until ARGV[10] at most.
    local kept = math.min(tonumber(d[3]), tonumber(ARGV[10]))
    redis.call(
      'HSET', key, 'status', 'delivered', 'payload', '', 'attempts', number, 'last_attempt_at', ARGV[1],
      'last_error', '', 'attempt_log', log, 'expires_at', kept
    )
    redis.call('HDEL', key, 'lease_owner')
    redis.call('PEXPIREAT', key, kept)
    unlist(id)
    redis.call('ZADD', expiry, kept, id)
    redis.call('ZADD', delivered, '-' .. ARGV[1], id)
    -- Bounded whatever the rate: beyond ARGV[12] delivered ones, the oldest (the highest scores) go. One is
    -- added per call, so one goes per call once the bound is met; a lowered bound is caught up 100 at a time.
    local over = math.min(redis.call('ZCARD', delivered) - tonumber(ARGV[12]), 100)
    if over > 0 then
      for _, old in ipairs(redis.call('ZRANGE', delivered, -over, -1)) do
        drop(old)
      end
    end
    extend()
    return {1, d[4]}
  end
  redis.call('HSET', key, 'attempts', number, 'last_attempt_at', ARGV[1], 'last_error', ARGV[8], 'attempt_log', log)
  redis.call('HDEL', key, 'lease_owner')
  redis.call('ZREM', leased, id)
  if outcome == 'retry' then
    redis.call('HSET', key, 'next_attempt_at', ARGV[7])
    redis.call('ZADD', due, ARGV[7], id)
  else
    redis.call('HSET', key, 'status', 'failed')
    redis.call('ZREM', due, id)
    redis.call('ZREM', created, id)
    redis.call('ZADD', failed, '-' .. ARGV[1], id)
  end
  extend()
  return {1, d[4]}
end

if op == 'redeliver' then
  local id = ARGV[4]
  local key = prefix .. id
  local fields = live(id)
  if not fields or field(fields, 'status') == 'delivered' then
    return {}
  end
  if field(fields, 'status') == 'failed' then
    redis.call('HSET', key, 'status', 'queued', 'attempts', 0, 'next_attempt_at', ARGV[1])
    redis.call('HDEL', key, 'lease_owner')
    redis.call('ZREM', failed, id)
    redis.call('ZADD', due, ARGV[1], id)
    redis.call('ZADD', created, field(fields, 'created_at'), id)
    extend()
    fields = redis.call('HGETALL', key)
  end
  return {id, fields}
end

if op == 'remove' then
  local out = {}
  for i = 5, #ARGV do
    local id = ARGV[i]
    local found = redis.call('HMGET', prefix .. id, 'subject', 'status')
    local subject = found[1]
    if not subject then
      unlist(id)
    elseif ARGV[4] == '' or subject == ARGV[4] then
      drop(id)
      out[#out + 1] = id
      out[#out + 1] = subject
      out[#out + 1] = found[2] or ''
    end
  end
  return out
end

if op == 'drop' then
  local ids = redis.call('ZRANGE', expiry, 0, tonumber(ARGV[4]) - 1)
  for _, id in ipairs(ids) do
    drop(id)
  end
  if #ids < tonumber(ARGV[4]) then  -- the last batch: what may be left in the other sets goes too
    redis.call('DEL', due, leased, failed, created, delivered)
  end
  return ids
end

if op == 'list' then
  purge()
  local state, limit = ARGV[4], tonumber(ARGV[5])
  local listed = ({queued = created, failed = failed, delivered = delivered})[state]
  if not listed then
    return redis.error_reply('webhook_queue.lua: unknown state ' .. tostring(state))
  end
  local out = {}
  for _ = 1, ROUNDS do
    local want = limit - #out
    if want <= 0 then
      break
    end
    -- What was kept stays in front (the set's order does not change); what was dropped left it.
    local ids = redis.call('ZRANGE', listed, #out, #out + want - 1)
    if #ids == 0 then
      break
    end
    for _, id in ipairs(ids) do
      local fields = live(id)
      if fields then
        out[#out + 1] = {id, fields}
      end
    end
  end
  return out
end

if op == 'stats' then
  purge()
  local oldest = redis.call('ZRANGE', created, 0, 0, 'WITHSCORES')
  return {redis.call('ZCARD', created), redis.call('ZCARD', failed), oldest[2] or '-1'}
end

return redis.error_reply('webhook_queue.lua: unknown operation ' .. tostring(op))
