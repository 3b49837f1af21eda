--[[
unlist.lua: remove conversations from a project's analytics listing (erasure of their caller).

KEYS[1..3]  the listing indexes  cm:{a:<project>}:i:all, :i:repeat, :i:first
KEYS[4..]   the listed entries   cm:{a:<project>}:e:<conversation_id>
Counters are anonymous and stay. Returns how many entries were removed.
]]
local removed = 0
for k = 4, #KEYS do
  local value = redis.call('GET', KEYS[k])
  if value then
    -- "<expires_at>|<recorded_at>|<json>" (or "<expires_at>|<json>" from earlier releases)
    local json = string.sub(value, (string.find(value, '{', 1, true)))
    local entry = cjson.decode(json)
    local member = string.format('%013d:%s', entry.hour, entry.conversation_id)
    redis.call('ZREM', KEYS[1], member)
    redis.call('ZREM', KEYS[2], member)
    redis.call('ZREM', KEYS[3], member)
    redis.call('DEL', KEYS[k])
    removed = removed + 1
  end
end
return removed
