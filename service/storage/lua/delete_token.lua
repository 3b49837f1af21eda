--[[
delete_token.lua: revoke a token of one project (Store.delete_token), atomically.

KEYS[1]  cm:t:<token_id>, KEYS[2] cm:p:<project>:tokens
ARGV[1]  project, ARGV[2] token_id
Returns 1 if the token existed in that project and was removed, 0 otherwise (another project's token is
left alone). Not usable on Redis Cluster as is: the two keys live in different slots.
]]
if redis.call('HGET', KEYS[1], 'project') ~= ARGV[1] then
  redis.call('ZREM', KEYS[2], ARGV[2]) -- a stray id in this project's index, if any; harmless otherwise
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
