--[[
webhook_register.lua: list deliveries about a caller among the caller's, in the caller's slot, before the
deliveries are written (WebhookStore.enqueue_deliveries): an erasure of the caller finds what is listed here
(WebhookStore.delete_caller_deliveries).

KEYS[1]  the caller's deliveries   cm:{<bucket>}:wc:<project>:<subject>   zset delivery_id -> expires_at
KEYS[2]  the caller's tombstone    cm:{<bucket>}:t:<project>:<subject>
ARGV: now_ms, made_at ("" to list without looking at the tombstone: deliveries queued without their caller),
then pairs of a delivery id and its expires_at.

Returns 0 without listing anything when the caller was erased at or after made_at (a live tombstone), else 1.
Entries whose delivery expired are forgotten here; the set lives until the latest expiry it holds.
]]
local now = tonumber(ARGV[1])
if ARGV[2] ~= '' then
  local tomb = redis.call('HMGET', KEYS[2], 'erased_at', 'expires_at')
  if tomb[1] and tonumber(tomb[2]) > now and tonumber(tomb[1]) >= tonumber(ARGV[2]) then
    return 0
  end
end
if #ARGV < 3 then
  return 1
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 3, #ARGV, 2 do
  redis.call('ZADD', KEYS[1], 'GT', ARGV[i + 1], ARGV[i])
end
local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if top[2] then
  redis.call('PEXPIREAT', KEYS[1], top[2])
end
return 1
