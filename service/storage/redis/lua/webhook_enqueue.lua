--[[
webhook_enqueue.lua: queue deliveries (WebhookStore.enqueue_deliveries). The call is made of parts, each
writing keys of one slot: on one server the service sends the whole enqueue as one call (every part: one
atomic step, one round trip); on a Redis Cluster one call per slot, the callers' listings and the project's
index first, then the queues (see webhooks.py for why in that order).

ARGV[1] now_ms, then the parts one after the other, each its kind and its arguments; each takes the next KEYS:
  list   made_at ("" to list without reading the tombstone: deliveries queued without their caller), n, then n
         pairs of a delivery id and its expires_at. KEYS: the caller's deliveries (zset id -> expires_at,
         cm:{<bucket>}:wc:<project>:<subject>) and the caller's tombstone
         (cm:{<bucket>}:t:<project>:<subject>).
         Entries whose delivery expired are forgotten; the set lives until the latest expiry it holds.
  index  n, then n triples of a delivery id, its endpoint id and its expires_at: each id is indexed for that
         endpoint unless it lives for another one. KEYS: the three of webhook_index.lua (its layout is there).
  queue  the prefix of the delivery hashes (as for webhook_queue.lua), the endpoint id, the endpoint's member
         in the work index, n, then n deliveries of 11: id, event, payload, subject, created_at, expires_at,
         status, attempts, next_attempt_at, last_attempt_at, last_error. KEYS: the five of webhook_queue.lua
         (its layout is there). A delivery whose id lives here is left as it is; an expired or a delivered one
         is replaced (its kept attempts with it).
  work   (no arguments) KEYS: the endpoints with deliveries of every project (cm:wwork, zset member -> latest
         expiry): each queue part of the call marks its endpoint there until the latest expiry its queue
         holds.
  ends   E, C, then E endpoints, each its id and its member in the work index, then C callers, each its
         made_at, its pseudonym, created_at and n, then n deliveries of 5: the number of their endpoint (1 to
         E), id, event, payload, expires_at. The deliveries of ends, each caller's just made (queued at
         created_at, no attempt yet), for one project: it stands for a list part per caller, the index part,
         the work part and a queue part per endpoint, in a fraction of their arguments; the service sends the
         ends of one turn of its event loop together (an end's enqueue is on the request path). A caller
         erased at or after its made_at is left out alone: nothing of it is written, the others are. Its index
         part deletes C times as much of what expired (as C calls would). Alone in its call. KEYS: the index
         part's three, the work part's one, each endpoint's five queue keys (its hashes' prefix is named from
         the first), then each caller's two of a list part.

With an ends part: one flag per caller, 1 when its deliveries were queued, 0 when it was erased (above).
Else: returns 0, writing nothing at all, when the tombstone of a list part with a made_at says its caller was
erased at or after made_at; else the index part's flags, one per triple ({} without an index part): 1 when the id is
that endpoint's, 0 when it lives for another endpoint (left as it is). A queue part writes only the ids the
index part of the same call gave its endpoint; without one, every id it is given (on a cluster the service
leaves out the ids flagged 0).

Every key a part writes expires (PEXPIREAT) at the latest expiry it holds, a delivery's hash at its
expires_at.
Each index and queue part first deletes a bounded batch of what expired there, as webhook_index.lua and
webhook_queue.lua do.
]]
local now = tonumber(ARGV[1])
-- Expired entries deleted per part: bounded (Lua's stack, the script's run time); the rest at later calls.
local PURGE = 200

-- Whether the caller of this tombstone was erased at or after made_at.
local function erased(tomb, made_at)
  local found = redis.call('HMGET', tomb, 'erased_at', 'expires_at')
  return found[1] and tonumber(found[2]) > now and tonumber(found[1]) >= tonumber(made_at)
end

-- The parts, read before anything is written (the tombstones are read first).
local lists, indexes, queues, work, callers = {}, {}, {}, nil, nil
local k, a = 1, 2
while a <= #ARGV do
  local kind = ARGV[a]
  if kind == 'list' then
    local n = tonumber(ARGV[a + 2])
    local entries = {}
    for i = a + 3, a + 2 + 2 * n, 2 do
      entries[#entries + 1] = {ARGV[i], ARGV[i + 1]}
    end
    lists[#lists + 1] = {listing = KEYS[k], tomb = KEYS[k + 1], made_at = ARGV[a + 1], entries = entries}
    k, a = k + 2, a + 3 + 2 * n
  elseif kind == 'index' then
    local n = tonumber(ARGV[a + 1])
    local entries = {}
    for i = a + 2, a + 1 + 3 * n, 3 do
      entries[#entries + 1] = {ARGV[i], ARGV[i + 1], ARGV[i + 2]}
    end
    indexes[#indexes + 1] = {ids = KEYS[k], expiries = KEYS[k + 1], endpoints = KEYS[k + 2], entries = entries}
    k, a = k + 3, a + 2 + 3 * n
  elseif kind == 'queue' then
    local n = tonumber(ARGV[a + 4])
    local entries = {}
    for i = a + 5, a + 4 + 11 * n, 11 do
      entries[#entries + 1] = {
        ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7],
        ARGV[i + 8], ARGV[i + 9], ARGV[i + 10],
      }
    end
    queues[#queues + 1] = {
      keys = {KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]},
      prefix = ARGV[a + 1], endpoint = ARGV[a + 2], member = ARGV[a + 3], entries = entries,
    }
    k, a = k + 5, a + 5 + 11 * n
  elseif kind == 'work' then
    work = KEYS[k]
    k, a = k + 1, a + 1
  elseif kind == 'ends' then
    local e, c = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local indexed = {}
    -- It stands for the index parts of C calls: it deletes as much of what expired as they would have.
    indexes[#indexes + 1] = {
      ids = KEYS[k], expiries = KEYS[k + 1], endpoints = KEYS[k + 2], entries = indexed, purge = PURGE * c,
    }
    work = KEYS[k + 3]
    k, a = k + 4, a + 3
    local endpoints = {}
    for j = 1, e do
      endpoints[j] = {
        keys = {KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]},
        prefix = string.sub(KEYS[k], 1, -2) .. 'd:', endpoint = ARGV[a], member = ARGV[a + 1], entries = {},
      }
      queues[#queues + 1] = endpoints[j]
      k, a = k + 5, a + 2
    end
    callers = {}
    for _ = 1, c do
      local made_at, subject, created, n = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
      local listing, tomb = KEYS[k], KEYS[k + 1]
      k, a = k + 2, a + 4
      if erased(tomb, made_at) then
        callers[#callers + 1] = 0
      else
        callers[#callers + 1] = 1
        local listed = {}
        lists[#lists + 1] = {listing = listing, tomb = tomb, made_at = '', entries = listed}
        for i = a, a + 5 * n - 1, 5 do
          local queue, id, expires = endpoints[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 4]
          listed[#listed + 1] = {id, expires}
          indexed[#indexed + 1] = {id, queue.endpoint, expires}
          queue.entries[#queue.entries + 1] = {
            id, ARGV[i + 2], ARGV[i + 3], subject, created, expires, 'queued', '0', created, '0', '',
          }
        end
      end
      a = a + 5 * n
    end
  else
    return redis.error_reply('webhook_enqueue.lua: unknown part ' .. tostring(kind))
  end
end
if k - 1 ~= #KEYS then
  return redis.error_reply('webhook_enqueue.lua: the parts take ' .. (k - 1) .. ' keys, not ' .. #KEYS)
end

for _, part in ipairs(lists) do
  if part.made_at ~= '' and erased(part.tomb, part.made_at) then
    return 0
  end
end

local function extend(key, also)
  local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if top[2] then
    redis.call('PEXPIREAT', key, top[2])
    for _, other in ipairs(also or {}) do
      redis.call('PEXPIREAT', other, top[2])
    end
  end
  return top[2]
end

-- The callers' listings (what an erasure follows).
for _, part in ipairs(lists) do
  if #part.entries > 0 then
    redis.call('ZREMRANGEBYSCORE', part.listing, '-inf', now)
    for _, entry in ipairs(part.entries) do
      redis.call('ZADD', part.listing, 'GT', entry[2], entry[1])
    end
    extend(part.listing)
  end
end

-- The project's index: which endpoint each id is queued for (refused: the ids left to another endpoint).
local flags, refused = {}, {}
for _, part in ipairs(indexes) do
  for _, id in ipairs(redis.call('ZRANGE', part.expiries, '-inf', now, 'BYSCORE', 'LIMIT', 0, part.purge or PURGE)) do
    redis.call('HDEL', part.ids, id)
    redis.call('ZREM', part.expiries, id)
  end
  redis.call('ZREMRANGEBYSCORE', part.endpoints, '-inf', now)
  for _, entry in ipairs(part.entries) do
    local id, endpoint, expires = entry[1], entry[2], entry[3]
    local current = redis.call('HGET', part.ids, id)
    if current and current ~= endpoint and tonumber(redis.call('ZSCORE', part.expiries, id) or 0) > now then
      flags[#flags + 1] = 0
      refused[endpoint] = refused[endpoint] or {}
      refused[endpoint][id] = true
    else
      redis.call('HSET', part.ids, id, endpoint)
      if current ~= endpoint then
        redis.call('ZADD', part.expiries, expires, id)
      else
        redis.call('ZADD', part.expiries, 'GT', expires, id)
      end
      redis.call('ZADD', part.endpoints, 'GT', expires, endpoint)
      flags[#flags + 1] = 1
    end
  end
  extend(part.expiries, {part.ids})
  extend(part.endpoints)
end

-- The endpoints' queues.
for _, part in ipairs(queues) do
  local due, leased, failed, expiry, created = unpack(part.keys)
  -- The delivered ones (webhook_queue.lua names it so, in the same slot).
  local delivered = string.sub(due, 1, -2) .. 'v'
  local prefix = part.prefix
  local function unlist(id)
    for _, key in ipairs(part.keys) do
      redis.call('ZREM', key, id)
    end
    redis.call('ZREM', delivered, id)
  end
  local function drop(id)
    redis.call('DEL', prefix .. id)
    unlist(id)
  end
  for _, id in ipairs(redis.call('ZRANGE', expiry, '-inf', now, 'BYSCORE', 'LIMIT', 0, PURGE)) do
    drop(id)
  end
  local skip = refused[part.endpoint] or {}
  for _, d in ipairs(part.entries) do
    local id, expires = d[1], d[6]
    local key = prefix .. id
    local found = redis.call('HMGET', key, 'expires_at', 'status')
    local current = found[1]
    if current and (tonumber(current) <= now or found[2] == 'delivered') then
      drop(id)
      current = nil
    end
    if not current and tonumber(expires) > now and not skip[id] then
      local status = d[7]
      -- (No DEL first: the hash is not there, or was just dropped, whenever current is nil here.)
      redis.call(
        'HSET', key, 'event', d[2], 'payload', d[3], 'subject', d[4], 'created_at', d[5], 'expires_at', expires,
        'status', status, 'attempts', d[8], 'next_attempt_at', d[9], 'last_attempt_at', d[10], 'last_error', d[11]
      )
      redis.call('PEXPIREAT', key, expires)
      unlist(id)
      redis.call('ZADD', expiry, expires, id)
      if status == 'failed' then
        redis.call('ZADD', failed, '-' .. d[10], id)
      else
        redis.call('ZADD', due, d[9], id)
        redis.call('ZADD', created, d[5], id)
      end
    end
  end
  -- Every key of the queue lives until the latest expiry it holds (a set created here too).
  local top = extend(expiry, {due, leased, failed, created, delivered})
  if work and top then
    -- NX gives a new key its expiry, GT only ever moves it later.
    redis.call('ZADD', work, 'GT', top, part.member)
    redis.call('PEXPIREAT', work, top, 'NX')
    redis.call('PEXPIREAT', work, top, 'GT')
  end
end

if callers then
  return callers
end
return flags
