--[[
link_absorb.lua: the third step of a link (LinkStore.link_identifier), in the profile's slot: merge the
identifier's memory (as link_alias.lua returned it) into the profile's, and mark the link made.

KEYS[1]  the profile's memory hash         cm:{<bucket>}:m:<project>:<profile>
KEYS[2]  its bucket's expiry index         cm:{<bucket>}:x
KEYS[3]  its first interaction             cm:{<bucket>}:f:<project>:<profile>
KEYS[4]  its links                         cm:{<bucket>}:ll:<project>:<profile>
KEYS[5]  its tombstone                     cm:{<bucket>}:t:<project>:<profile>
ARGV     now (ms), the profile's member in the expiry index, the identifier's subject, the link's link_id,
         kind, linked_at and expires_at, the profile's erasure mark as link_reserve.lua found it, F, then F pairs of name and packed field (the identifier's live
         fields), then the identifier's first interaction as flat field/value pairs (none: it has none)

The merge rule: per field the one written later (written_at) wins, the profile's on a tie (or when the
profile's is dead: then the identifier's); the first interaction is the one created earlier (created_at; a
record without it counts as created at its hour), the profile's on a tie, and the merged record keeps the later
of each seen_hour, seen_day, seen_week (the caller was seen in those buckets, whichever identifier called).
The merge is applied once per link: an entry already marked made ("d") means it was applied (a step 4 that did
not run is finished by the service without merging again: a field deleted from the profile since then must
not come back). The entry is written whole (state "d"), also when it was taken back meanwhile by a refused
attempt of the same link: the identifier's alias record, set by step 2, names it.

An erasure of the profile after the link was begun wins: nothing is written (what step 2 returned may be what
that erasure removed from the identifier). It is known by the tombstone's mark having changed since step 1
(whatever the clocks say: an erasure stamped at the link's own millisecond, or by a replica whose clock lags,
is one), and by a tombstone erased_at after now (an erasure stamped after the link began).

Returns {0} when the profile was erased so, else {1, fields merged, 1 if the first interaction was the
identifier's (else 0)}.
]]
local now = tonumber(ARGV[1])
local member, subject = ARGV[2], ARGV[3]
local link_id, kind, linked_at, expires_at = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local mark = ARGV[8]
local count = tonumber(ARGV[9])
local first_start = 10 + 2 * count

local tomb = redis.call('HMGET', KEYS[5], 'erased_at', 'expires_at')
if tomb[1] and (tomb[1] ~= mark or (tonumber(tomb[2]) > now and tonumber(tomb[1]) > now)) then
  return {0}
end

-- #include field.lua

local entry = redis.call('HGET', KEYS[4], subject)
local merged, first_merged = 0, 0
if not (entry and string.sub(entry, 1, 2) == 'd|') then
  if count > 0 then
    local stored = {}
    local raw = redis.call('HGETALL', KEYS[1])
    for i = 1, #raw, 2 do
      local f = parse(raw[i + 1])
      if not f then
        return redis.error_reply('CMCORRUPT unreadable field in ' .. KEYS[1])
      end
      stored[raw[i]] = f
    end
    local written = {}
    for i = 10, first_start - 1, 2 do
      local name, f = ARGV[i], parse(ARGV[i + 1])
      if not f then
        return redis.error_reply('CMBADARG malformed packed field')
      end
      local mine = stored[name]
      if f[3] > now and not (mine and mine[3] > now and mine[4] >= f[4]) then
        stored[name] = f
        written[#written + 1] = name
        written[#written + 1] = f[1]
        merged = merged + 1
      end
    end
    if #written > 0 then
      -- Dead fields go on the way (as patch.lua does); the hash and its index entry follow the live ones.
      local dead, min_f, max_f = {}, nil, nil
      for name, f in pairs(stored) do
        if f[3] <= now then
          dead[#dead + 1] = name
        else
          if not min_f or f[3] < min_f[3] then
            min_f = f
          end
          if not max_f or f[3] > max_f[3] then
            max_f = f
          end
        end
      end
      for s = 1, #dead, 1000 do
        redis.call('HDEL', KEYS[1], unpack(dead, s, math.min(s + 999, #dead)))
      end
      for s = 1, #written, 1000 do
        redis.call('HSET', KEYS[1], unpack(written, s, math.min(s + 999, #written)))
      end
      redis.call('PEXPIREAT', KEYS[1], max_f[2])
      redis.call('ZADD', KEYS[2], min_f[2], member)
    end
  end

  if #ARGV >= first_start then
    local theirs = {}
    for i = first_start, #ARGV, 2 do
      theirs[ARGV[i]] = ARGV[i + 1]
    end
    local raw = redis.call('HGETALL', KEYS[3])
    local mine = {}
    for i = 1, #raw, 2 do
      mine[raw[i]] = raw[i + 1]
    end
    local mine_live = mine.expires_at and tonumber(mine.expires_at) > now
    local function created(record)
      return tonumber(record.created_at or record.hour)
    end
    local kept = mine
    if not mine_live or created(theirs) < created(mine) then
      kept = theirs
      first_merged = 1
    end
    local record = {}
    for name, value in pairs(kept) do
      record[name] = value
    end
    for _, name in ipairs({'seen_hour', 'seen_day', 'seen_week'}) do
      -- (a dead record's buckets are not looked at, as patch.lua does not)
      for _, value in ipairs({mine_live and mine[name] or false, theirs[name] or false}) do
        if value and (not record[name] or tonumber(value) > tonumber(record[name])) then
          record[name] = value
        end
      end
    end
    local flat = {}
    for name, value in pairs(record) do
      flat[#flat + 1] = name
      flat[#flat + 1] = value
    end
    redis.call('DEL', KEYS[3])
    redis.call('HSET', KEYS[3], unpack(flat))
    redis.call('PEXPIREAT', KEYS[3], record.expires_at)
  end
end

-- The entry, made; the hash expires at its latest live entry.
redis.call('HSET', KEYS[4], subject, 'd|' .. linked_at .. '|' .. expires_at .. '|' .. kind .. '|' .. link_id)
local latest, latest_s = tonumber(expires_at), expires_at
for _, value in ipairs(redis.call('HVALS', KEYS[4])) do
  local e = string.match(value, '^%a|%d+|(%d+)|')
  if e and tonumber(e) > latest then
    latest, latest_s = tonumber(e), e
  end
end
redis.call('PEXPIREAT', KEYS[4], latest_s)
return {1, merged, first_merged}
