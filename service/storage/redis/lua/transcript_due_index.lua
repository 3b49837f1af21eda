--[[
transcript_due_index.lua: correct entries of the due index that due_conversations found stale, each only if
its score is still the one that was read (a write in between, such as a creation, wins).

KEYS[1]  the due index   cm:vdue
ARGV: triples of member, the score read, the new score ("" to remove it)

Returns how many entries were changed.
]]
local changed = 0
for i = 1, #ARGV, 3 do
  local current = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if current and tonumber(current) == tonumber(ARGV[i + 1]) then
    if ARGV[i + 2] == '' then
      redis.call('ZREM', KEYS[1], ARGV[i])
    else
      redis.call('ZADD', KEYS[1], ARGV[i + 2], ARGV[i])
    end
    changed = changed + 1
  end
end
return changed
