--[[
link_reserve.lua: the first step of a link (LinkStore.link_identifier), in the profile's slot: refuse a
profile that is itself an alias, then find the identifier's entry in the profile's links or reserve one.

KEYS[1]  the profile's alias record   cm:{<bucket>}:la:<project>:<profile>
KEYS[2]  the profile's links          cm:{<bucket>}:ll:<project>:<profile>  (same slot: the profile's tag)
KEYS[3]  the profile's tombstone      cm:{<bucket>}:t:<project>:<profile>: its erasure mark (its erased_at, ""
         when none) is returned, and link_absorb.lua refuses to merge if the mark changed meanwhile (an erasure
         of the profile landed between the steps of the link, whatever the clocks of the two say)
ARGV     now (ms), the identifier's subject, then the new link's link_id, kind, linked_at, expires_at,
         max_links (live links the profile may have), and "1" if the identifier is the profile itself

An entry is "<state>|<linked_at>|<expires_at>|<kind>|<link_id>", state "p" while the link is being made
(reserved here; counted as a live link, so the profile is never made an alias meanwhile: link_alias.lua
refuses an identifier with live links) and "d" once made (link_absorb.lua). Expired entries are removed on the
way; the hash expires at its latest entry's expiry.

Returns {0, link_id, linked_at, kind, "p", mark} for a new entry, {1, link_id, linked_at, kind, state, mark} for
the identifier's live entry (kept as it is: its id and linked_at are reused), {2} when the profile has max_links
live links already, {3, profile} when the profile is a live alias of that profile, {4} when the identifier is
the profile itself (after the alias check: a profile that is an alias is moved, whatever is linked to it).
Nothing but expired entries is written unless the status is 0.
]]
local now = tonumber(ARGV[1])
local subject = ARGV[2]

local alias = redis.call('GET', KEYS[1])
if alias then
  local e, profile = string.match(alias, '^(%d+)|([^|]*)|')
  if e and tonumber(e) > now then
    return {3, profile}
  end
end
if ARGV[8] == '1' then
  return {4}
end

local mark = redis.call('HGET', KEYS[3], 'erased_at') or ''
local raw = redis.call('HGETALL', KEYS[2])
-- latest is kept as the stored string too: it goes back to Redis as it came
local live, dead, latest, latest_s, mine = 0, {}, 0, nil, nil
for i = 1, #raw, 2 do
  local state, linked, e, kind, id = string.match(raw[i + 1], '^(%a)|(%d+)|(%d+)|([^|]*)|(.*)$')
  if not state then
    return redis.error_reply('CMCORRUPT unreadable link in ' .. KEYS[2])
  end
  local n = tonumber(e)
  if n <= now then
    dead[#dead + 1] = raw[i]
  else
    if n > latest then
      latest, latest_s = n, e
    end
    if raw[i] == subject then
      mine = {1, id, linked, kind, state, mark}
    else
      live = live + 1
    end
  end
end
for s = 1, #dead, 1000 do
  redis.call('HDEL', KEYS[2], unpack(dead, s, math.min(s + 999, #dead)))
end
if mine then
  return mine
end
if live >= tonumber(ARGV[7]) then
  return {2}
end
local link_id, kind, linked_at, expires_at = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
redis.call('HSET', KEYS[2], subject, 'p|' .. linked_at .. '|' .. expires_at .. '|' .. kind .. '|' .. link_id)
if tonumber(expires_at) > latest then
  latest_s = expires_at
end
redis.call('PEXPIREAT', KEYS[2], latest_s)
return {0, link_id, linked_at, kind, 'p', mark}
