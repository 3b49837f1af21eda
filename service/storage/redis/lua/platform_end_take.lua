-- Take a held platform end (storage/redis/platform_events.py): KEYS[1] the documents' hash, KEYS[2] the due
-- index (one slot); ARGV[1] the member (project, NUL, conversation id). Answers the document or nil.
local document = redis.call('HGET', KEYS[1], ARGV[1])
if document then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return document
