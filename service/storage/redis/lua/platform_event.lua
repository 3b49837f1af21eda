-- The first sighting of a platform's event id (storage/redis/platform_events.py): KEYS[1] the id's key;
-- ARGV[1] now (ms), ARGV[2] keep until (ms). The value is the expiry: a kept value at or before now is dead.
local kept = redis.call('GET', KEYS[1])
local now = tonumber(ARGV[1])
if kept and tonumber(kept) > now then
  return 0
end
local ttl = tonumber(ARGV[2]) - now
if ttl < 1 then
  ttl = 1
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
return 1
