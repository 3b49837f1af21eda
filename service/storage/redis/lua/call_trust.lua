-- Keep or raise a conversation's call trust (storage/redis/call_trust.py): KEYS[1] its hash; ARGV[1] the
-- attestation (kept only when none is), ARGV[2] '1' to mark step-up passed, ARGV[3] the record's expiry
-- (ms; the later one stays), ARGV[4] now (ms: a record expired by then is replaced whole).
local kept = tonumber(redis.call('HGET', KEYS[1], 'expires_at') or '0')
if kept <= tonumber(ARGV[4]) then
  redis.call('DEL', KEYS[1])
  kept = 0
end
redis.call('HSETNX', KEYS[1], 'attestation', ARGV[1])
if ARGV[2] == '1' then
  redis.call('HSET', KEYS[1], 'step_up', '1')
end
local wanted = tonumber(ARGV[3])
if wanted > kept then
  redis.call('HSET', KEYS[1], 'expires_at', ARGV[3])
  kept = wanted
end
redis.call('PEXPIREAT', KEYS[1], kept)
return 1
