--[[
erase.lua: remove everything stored about one caller in the caller's slot (Store.erase_caller), atomically,
and leave a tombstone.

KEYS[1]  the caller's memory hash          cm:{<bucket>}:m:<project>:<subject>
KEYS[2]  the bucket's expiry index         cm:{<bucket>}:x
KEYS[3]  the caller's first interaction    cm:{<bucket>}:f:<project>:<subject>
KEYS[4]  the caller's conversation ids     cm:{<bucket>}:cs:<project>:<subject>
KEYS[5]  the caller's tombstone            cm:{<bucket>}:t:<project>:<subject>
KEYS[6]  the caller's transcripts          cm:{<bucket>}:vc:<project>:<subject> (conv_id -> horizon): read here;
         the service then replaces each conversation by a marker in its own slot (transcript_remove.lua) and
         only then takes them off this listing, so that an erasure cut short is found again by its retry
KEYS[7]  the caller's alias record         cm:{<bucket>}:la:<project>:<subject> (optional, with KEYS[8])
KEYS[8]  the caller's links (as a profile) cm:{<bucket>}:ll:<project>:<subject>: both removed; the aliases
         the links name are in other slots, erased by the domain (each is erased as a caller of its own)
ARGV[1]  the caller's member in the expiry index
ARGV[2]  the prefix of the caller's conversation records, "cm:{<bucket>}:c:<project>:" (same slot: the
         records are named from the set's members, which is why they are not in KEYS)
ARGV[3]  erased_at (ms), ARGV[4] when the tombstone expires (ms), ARGV[5] the caller's subject

Every conversation id the erasure removes something of (a transcript in KEYS[6], a record in KEYS[4]) is kept in
the tombstone as a field "c:<conversation id>" (the id without a "#late" or "#takeover" suffix) -> until when
(its horizon, or its record's expiry), and the tombstone lives as long as its latest such field: an end of that
conversation by this caller, whatever record id it is kept under and whenever it says it was made, is refused
as erased (patch.lua checks it in the same atomic step as its write). Fields past their time are pruned here.

Each conversation record still live (by the service's clock, ARGV[3]) is replaced by an erasure marker
{erased = "1", expires_at} that keeps nothing about the caller and lives as long as the record would have:
a later end of that conversation id is refused as erased (patch.lua), whenever it says it was made. A
record that names another caller (the id was reused once the caller's record had expired; records are
named by bucket and id) is not the caller's and is left alone, as is that id's claim and listing.

Returns {fields removed, first interaction removed (0/1), links removed (the live entries of KEYS[8], plus 1
if KEYS[7] was a live alias record), the profile KEYS[7] named while live ("" if none), L, then the subjects
of the L live entries of KEYS[8] (the aliases the domain erases next), T, then T pairs of a transcript's
conversation id
and its horizon, then for each conversation id of an ended conversation: the id and the expires_at of its
marker ("0" when its record had expired and no marker was left)}.
]]
local now = tonumber(ARGV[3])
local tomb_until = tonumber(ARGV[4])
-- The conversations this erasure removes, by id without its suffix -> until when an end of it is refused.
local held = {}
local function hold(id, horizon)
  local base = string.match(id, '^[^#]+')
  local h = tonumber(horizon)
  if base and h and h > now and h > (held[base] or 0) then
    held[base] = h
  end
end
local fields = redis.call('HLEN', KEYS[1])
local first = redis.call('DEL', KEYS[3])
local ids = redis.call('SMEMBERS', KEYS[4])
local transcripts = redis.call('ZRANGE', KEYS[6], 0, -1, 'WITHSCORES')
local links = 0
local profile = ''
local aliases = {}
if KEYS[8] then
  local alias = redis.call('GET', KEYS[7])
  if alias and tonumber(string.match(alias, '^(%d+)|') or '0') > now then
    links = 1
    profile = string.match(alias, '^%d+|([^|]*)') or ''
  end
  local entries = redis.call('HGETALL', KEYS[8])
  for i = 1, #entries, 2 do
    -- subject -> "<state>|<linked_at>|<expires_at>|..."; an expired one is no link any more (its key
    -- expires by itself)
    if tonumber(string.match(entries[i + 1], '^[^|]*|%d+|(%d+)|') or '0') > now then
      links = links + 1
      aliases[#aliases + 1] = entries[i]
    end
  end
  redis.call('DEL', KEYS[7], KEYS[8])
end
local out = {fields, first, links, profile, #aliases}
for _, alias in ipairs(aliases) do
  out[#out + 1] = alias
end
out[#out + 1] = #transcripts / 2
for i, item in ipairs(transcripts) do
  out[#out + 1] = item
  if i % 2 == 0 then
    hold(transcripts[i - 1], item)
  end
end
for _, id in ipairs(ids) do
  local key = ARGV[2] .. id
  local record = redis.call('HMGET', key, 'subject', 'expires_at', 'erased')
  if not record[3] and (not record[1] or record[1] == ARGV[5]) then
    local expires = record[2]
    hold(id, expires)
    redis.call('DEL', key)
    if record[1] and tonumber(expires) > now then
      redis.call('HSET', key, 'erased', '1', 'expires_at', expires)
      redis.call('PEXPIREAT', key, expires)
    else
      expires = '0'
    end
    out[#out + 1] = id
    out[#out + 1] = expires
  end
end
redis.call('DEL', KEYS[1], KEYS[4])
redis.call('ZREM', KEYS[2], ARGV[1])
-- The tombstone: the erasure's time, and the conversations it removed (earlier erasures' kept while live).
local kept = redis.call('HGETALL', KEYS[5])
for i = 1, #kept, 2 do
  local name = kept[i]
  if string.sub(name, 1, 2) == 'c:' then
    local h = tonumber(kept[i + 1])
    if h > now then
      if h > (held[string.sub(name, 3)] or 0) then
        held[string.sub(name, 3)] = h
      end
    else
      redis.call('HDEL', KEYS[5], name)
    end
  end
end
local lives = tomb_until
for base, h in pairs(held) do
  redis.call('HSET', KEYS[5], 'c:' .. base, h)
  if h > lives then
    lives = h
  end
end
redis.call('HSET', KEYS[5], 'erased_at', ARGV[3], 'expires_at', ARGV[4])
redis.call('PEXPIREAT', KEYS[5], lives)
return out
