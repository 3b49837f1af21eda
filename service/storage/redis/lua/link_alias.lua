--[[
link_alias.lua: the second step of a link (LinkStore.link_identifier), in the identifier's slot: refuse or
make the identifier an alias of the profile, and hand back its own memory for the merge.

KEYS[1]  the identifier's alias record        cm:{<bucket>}:la:<project>:<subject>
KEYS[2]  its links (as a profile of its own)  cm:{<bucket>}:ll:<project>:<subject>
KEYS[3]  its memory hash                      cm:{<bucket>}:m:<project>:<subject>
KEYS[4]  its first interaction                cm:{<bucket>}:f:<project>:<subject>
ARGV     now (ms), the profile's subject, link_id, expires_at (ms), merge ("1" or "")

The alias record is "<expires_at>|<profile>|<link_id>", expiring then (PEXPIREAT). From the moment it is set,
every write to the identifier is refused (patch.lua) and every read follows it: the identifier's own memory,
returned here, is left in place until the merge has put it in the profile (link_detach.lua removes it then), so
a read sees one side's fields or the other's, never neither.

Returns {status, F, then F pairs of name and packed field (its live fields), then its live first interaction
as flat field/value pairs (none if it has none)}. Status: 0 made an alias now, 1 it was an alias of this
profile already (its record takes the new expiry and link_id: a renewal, or a link cut short that is being
finished), 2 a live alias of another profile, 3 it has live links of its own, 4 it has memory (a live field or
a live first interaction) and merge was not given. A refusal (2 to 4) writes nothing and is {status} alone.
]]
-- #include field.lua

local now = tonumber(ARGV[1])
local profile, link_id, expires_at = ARGV[2], ARGV[3], ARGV[4]

local status = 0
local alias = redis.call('GET', KEYS[1])
if alias then
  local e, named = string.match(alias, '^(%d+)|([^|]*)|')
  if e and tonumber(e) > now then
    if named ~= profile then
      return {2}
    end
    status = 1
  end
end

if status == 0 then
  -- An identifier with live links (made or being made) is a profile: one hop at most.
  for _, entry in ipairs(redis.call('HVALS', KEYS[2])) do
    if tonumber(string.match(entry, '^%a|%d+|(%d+)|') or '0') > now then
      return {3}
    end
  end
end

local fields = {}
local raw = redis.call('HGETALL', KEYS[3])
for i = 1, #raw, 2 do
  local f = parse(raw[i + 1])
  if not f then
    return redis.error_reply('CMCORRUPT unreadable field in ' .. KEYS[3])
  end
  if f[3] > now then
    fields[#fields + 1] = raw[i]
    fields[#fields + 1] = raw[i + 1]
  end
end
local first = redis.call('HGETALL', KEYS[4])
local first_live = false
for i = 1, #first, 2 do
  if first[i] == 'expires_at' then
    first_live = tonumber(first[i + 1]) > now
  end
end

if status == 0 and ARGV[5] ~= '1' and (#fields > 0 or first_live) then
  return {4}
end

redis.call('SET', KEYS[1], expires_at .. '|' .. profile .. '|' .. link_id, 'PXAT', expires_at)
local out = {status, #fields / 2}
for _, item in ipairs(fields) do
  out[#out + 1] = item
end
if first_live then
  for _, item in ipairs(first) do
    out[#out + 1] = item
  end
end
return out
