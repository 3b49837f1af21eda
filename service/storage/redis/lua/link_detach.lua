--[[
link_detach.lua: in an alias's slot, remove its own memory once a merge put it in the profile (the fourth step
of LinkStore.link_identifier) and/or its alias record (LinkStore.unlink_identifier; a link whose profile was
erased while it was being made).

KEYS[1]  the alias record        cm:{<bucket>}:la:<project>:<subject>
KEYS[2]  its memory hash         cm:{<bucket>}:m:<project>:<subject>
KEYS[3]  its bucket's index      cm:{<bucket>}:x
KEYS[4]  its first interaction   cm:{<bucket>}:f:<project>:<subject>
ARGV     now (ms), the profile's subject, the link_id ("" for any), the alias's member in the expiry index,
         drop ("1": remove the alias record), own ("1": remove its own memory and first interaction)

Only while the record names this profile (and link): an identifier linked elsewhere since, or no longer an
alias, is left alone. Its own memory goes only while the record is live: a live alias cannot have been written
to since it became one (patch.lua), so what is there is what the merge moved (or its remains, after a merge
cut short between its steps); once the record has expired the identifier is a caller of its own again and its
memory is its own. Returns 1 if the record named the profile, else 0.
]]
local now = tonumber(ARGV[1])
local alias = redis.call('GET', KEYS[1])
if not alias then
  return 0
end
local e, profile, id = string.match(alias, '^(%d+)|([^|]*)|(.*)$')
if profile ~= ARGV[2] or (ARGV[3] ~= '' and id ~= ARGV[3]) then
  return 0
end
if ARGV[6] == '1' and tonumber(e) > now then
  redis.call('DEL', KEYS[2], KEYS[4])
  redis.call('ZREM', KEYS[3], ARGV[4])
end
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[1])
end
return 1
