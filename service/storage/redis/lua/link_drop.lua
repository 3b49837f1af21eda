--[[
link_drop.lua: remove one entry from a profile's links, in the profile's slot: a reservation taken back when
the identifier refused the link (pending only), or a link being unlinked (LinkStore.unlink_identifier).

KEYS[1]  the profile's links     cm:{<bucket>}:ll:<project>:<profile>
ARGV     the identifier's subject, the entry's link_id, pending ("1": only an entry still being made, state
         "p"; one that another attempt of the same link made meanwhile is kept)

Returns 1 if the entry was removed, else 0. The hash then expires at its latest remaining entry (or is gone).
]]
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then
  return 0
end
local state, id = string.match(entry, '^(%a)|%d+|%d+|[^|]*|(.*)$')
if id ~= ARGV[2] or (ARGV[3] == '1' and state ~= 'p') then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
local latest, latest_s = nil, nil
for _, value in ipairs(redis.call('HVALS', KEYS[1])) do
  local e = string.match(value, '^%a|%d+|(%d+)|')
  if e and (not latest or tonumber(e) > latest) then
    latest, latest_s = tonumber(e), e
  end
end
if latest_s then
  redis.call('PEXPIREAT', KEYS[1], latest_s)
end
return 1
