--[[
webhook_index.lua: a project's delivery index (WebhookStore), in the project's slot: which endpoint each
delivery id is queued for, so that a delivery is found by its id alone (settle, get, redeliver, delete) and a
delivery id is queued once in its project, whatever the endpoint.

KEYS[1]  delivery_id -> endpoint_id      cm:{wp:<project>}:wi   hash
KEYS[2]  delivery_id -> expires_at       cm:{wp:<project>}:wj   zset (entries past it are forgotten)
KEYS[3]  endpoint_id -> latest expiry    cm:{wp:<project>}:wk   zset: the endpoints that have deliveries
ARGV[1]  now_ms, ARGV[2] the operation:
  add     then triples of a delivery id, its endpoint id and its expires_at: each id is indexed for that
          endpoint unless it lives for another one. Returns one flag per triple: 1 when the id is the
          endpoint's (the queue may write it), 0 when it lives for another endpoint (left as it is).
  remove  then pairs of a delivery id and an endpoint id: the id is forgotten if it is that endpoint's (it
          may have been queued again for another since). Returns how many were forgotten.

Written before the queue's own keys (an id never lives in a queue without an entry here), removed after them.
Every key lives until the latest expiry it holds.
]]
local now = tonumber(ARGV[1])
-- Entries forgotten per call: bounded (Lua's stack, the script's run time); a backlog goes over several.
local PURGE = 200

local function forget(id)
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end

local function extend(key)
  local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if top[2] then
    redis.call('PEXPIREAT', key, top[2])
  end
  return top[2]
end

if ARGV[2] == 'remove' then
  local removed = 0
  for i = 3, #ARGV, 2 do
    if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
      forget(ARGV[i])
      removed = removed + 1
    end
  end
  return removed
end

for _, id in ipairs(redis.call('ZRANGE', KEYS[2], '-inf', now, 'BYSCORE', 'LIMIT', 0, PURGE)) do
  forget(id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local flags = {}
for i = 3, #ARGV, 3 do
  local id, endpoint, expires = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local current = redis.call('HGET', KEYS[1], id)
  if current and current ~= endpoint and tonumber(redis.call('ZSCORE', KEYS[2], id) or 0) > now then
    flags[#flags + 1] = 0
  else
    redis.call('HSET', KEYS[1], id, endpoint)
    if current ~= endpoint then
      redis.call('ZADD', KEYS[2], expires, id)
    else
      redis.call('ZADD', KEYS[2], 'GT', expires, id)
    end
    redis.call('ZADD', KEYS[3], 'GT', expires, endpoint)
    flags[#flags + 1] = 1
  end
end
local top = extend(KEYS[2])
if top then
  redis.call('PEXPIREAT', KEYS[1], top)
end
extend(KEYS[3])
return flags
