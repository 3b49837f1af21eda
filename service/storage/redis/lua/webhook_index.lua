--[[
webhook_index.lua: a project's delivery index (WebhookStore), in the project's slot: which endpoint each
delivery id is queued for, so that a delivery is found by its id alone (settle, get, redeliver, delete) and a
delivery id is queued once in its project, whatever the endpoint. Entries are added by webhook_enqueue.lua
(its index part: an id is indexed for its endpoint unless it lives for another one); this script takes them
off.

KEYS[1]  delivery_id -> endpoint_id      cm:{wp:<project>}:wi   hash
KEYS[2]  delivery_id -> expires_at       cm:{wp:<project>}:wj   zset (entries past it are forgotten)
KEYS[3]  endpoint_id -> latest expiry    cm:{wp:<project>}:wk   zset: the endpoints that have deliveries
ARGV[1]  now_ms (unused), ARGV[2] the operation:
  remove  then pairs of a delivery id and an endpoint id: the id is forgotten if it is that endpoint's (it
          may have been queued again for another since). Returns how many were forgotten.

Written before the queue's own keys (an id never lives in a queue without an entry here), removed after them.
Every key lives until the latest expiry it holds.
]]
if ARGV[2] ~= 'remove' then
  return redis.error_reply('webhook_index.lua: unknown operation ' .. tostring(ARGV[2]))
end
local removed = 0
for i = 3, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
    removed = removed + 1
  end
end
return removed
