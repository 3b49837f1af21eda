--[[
lease.lua: take, renew or release a named lease (Store.acquire_lease / release_lease).

KEYS[1]  cm:lease:<name>, holding "<holder>|<expires_at ms>"
ARGV[1]  the holder's id, ARGV[2] now (ms, the service's clock), ARGV[3] time to live in ms (0: release)
A lease held by another holder is free once its expires_at has passed by the service's clock (Redis also
drops the key then, by its own clock). Returns 1 when the holder has the lease after the call, else 0.
]]
local current = redis.call('GET', KEYS[1])
local holder, expires = nil, 0
if current then
  local bar = string.find(current, '|', 1, true)
  holder = string.sub(current, 1, bar - 1)
  expires = tonumber(string.sub(current, bar + 1))
end
local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
if ttl == 0 then
  if holder == ARGV[1] then
    redis.call('DEL', KEYS[1])
  end
  return 0
end
if holder and holder ~= ARGV[1] and expires > now then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. (now + ttl), 'PX', ttl)
return 1
