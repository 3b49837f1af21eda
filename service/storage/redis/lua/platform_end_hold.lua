-- Hold a platform's first end event (storage/redis/platform_events.py): KEYS[1] the documents' hash, KEYS[2]
-- the due index (one slot); ARGV[1] the member, ARGV[2] the document, ARGV[3] the due time (ms).
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
