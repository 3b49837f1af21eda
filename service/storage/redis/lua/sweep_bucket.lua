--[[
sweep_bucket.lua: remove expired fields of the callers due in one bucket (Store.sweep).

KEYS[1]  the bucket's expiry index cm:{<bucket>}:x (member "<project>:<subject>", score = earliest expiry)
ARGV[1]  now (ms), ARGV[2] at most this many callers, ARGV[3] the bucket's key prefix "cm:{<bucket>}:m:"
(the memory hashes are named from the index members, in the same slot, which is why they are not in KEYS)

Only callers whose earliest expiry has passed are visited, so the cost follows what expired. Each visit
removes the dead fields, then re-files the caller under its new earliest expiry (and moves the hash's own
expiry to its latest field), or removes it when nothing is left. Safe to repeat and to interrupt.
Returns {fields removed, callers removed, 1 if more callers are due in this bucket else 0, callers visited}.
]]
-- #include field.lua

local now = tonumber(ARGV[1])
local due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
local fields, callers = 0, 0
for _, member in ipairs(due) do
  local hash = ARGV[3] .. member
  local raw = redis.call('HGETALL', hash)
  local dead, min_e, max_e = {}, nil, nil
  for i = 1, #raw, 2 do
    local f = parse(raw[i + 1])
    if f == nil then
      return redis.error_reply('CMCORRUPT unreadable field in ' .. hash)
    end
    local e = f[3]
    if e <= now then
      dead[#dead + 1] = raw[i]
    else
      if min_e == nil or e < min_e then
        min_e = e
      end
      if max_e == nil or e > max_e then
        max_e = e
      end
    end
  end
  for s = 1, #dead, 1000 do
    redis.call('HDEL', hash, unpack(dead, s, math.min(s + 999, #dead)))
  end
  fields = fields + #dead
  if min_e == nil then
    redis.call('DEL', hash)
    redis.call('ZREM', KEYS[1], member)
    callers = callers + 1
  else
    redis.call('ZADD', KEYS[1], min_e, member)
    redis.call('PEXPIREAT', hash, max_e)
  end
end
local more = 0
if #due == tonumber(ARGV[2]) then
  more = 1
end
return {fields, callers, more, #due}
