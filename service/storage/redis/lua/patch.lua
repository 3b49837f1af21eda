--[[
patch.lua: one atomic write to one caller's memory (Store.patch_fields). Redis 7.0+.

KEYS[1]  the caller's memory hash        cm:{<bucket>}:m:<project>:<subject>
KEYS[2]  the bucket's expiry index       cm:{<bucket>}:x   (same slot: the {bucket} hash tag)
KEYS[3]  the caller's alias record, cm:{<bucket>}:la:<project>:<subject>: while it is live (its expires_at
         after now_ms) the caller is an alias of another profile and nothing is written (status 5)
KEYS[4]  (end of a conversation only) the conversation record, cm:{<bucket>}:c:<project>:<conversation_id>
KEYS[5]  (end of a conversation only) the caller's tombstone, cm:{<bucket>}:t:<project>:<subject>
KEYS[6]  (end of a conversation only) the caller's conversation ids, cm:{<bucket>}:cs:<project>:<subject>
KEYS[7]  (end of a conversation only) the caller's first interaction, cm:{<bucket>}:f:<project>:<subject> (used
         with analytics only)
KEYS[8]  (end of a conversation on a standalone server only) the conversation id's claim,
         cm:{<cbucket>}:cc:<project>:<conversation_id>, another slot: on a cluster the service claims the id
         itself before running this script

ARGV, in order:
  now_ms                  the service's clock (integer ms since the epoch)
  member                  the caller's member in the expiry index, "<project>:<subject>"
  record                  "" for a plain patch; for the end of a conversation "R", followed by
                          subject, fingerprint, extra, expires_at (ms) of the conversation record, the
                          conversation id, when the write was made (made_at, ms), the claim
                          "<subject>|<expires_at>" to put in KEYS[8] ("" when there is no KEYS[8]), and
                          the write time of the sets and deletes (ms; "" for now_ms): a field whose
                          stored written_at is after it is neither set nor deleted (the later write wins)
  analytics               "" or, with a record, "A" followed by hour, day, week (bucket starts, ms), qa,
                          handoff_reason, handoff_to (each "" for none or "=" and the value), the
                          expiry of a first-interaction record created now, and first_after (ms): a
                          stored first interaction created at or before it is past the current retention
  mode                    ""  no condition
                          "*" If-Match: *  (holds when at least one field is live)
                          "=" If-Match: etag list (holds when the current ETag is one of them)
  E, then E etags         the entity tags, quotes included (E = 0 unless mode is "=")
  T, then T pairs         name, ttl_ms: the project's current TTLs, used only to evaluate the condition
                          (a field without an entry is not live; see fields.effective_expiry)
  S, then S pairs         name, packed: the fields to set, packed as field.lua reads them (either form)
  the rest                names of the fields to delete (applied before the sets)

Returns a flat array: status, then name, packed for every field whose stored expiry is after now_ms once
the script is done (unchanged memory unless status is 1). Status: 1 applied, 0 condition failed,
2 conversation replayed (the array is {2, fingerprint, extra, expires_at} then), 3 conversation conflict,
4 the caller was erased at or after made_at, or an erasure removed what this conversation id wrote (an
erasure marker in KEYS[4] or KEYS[8]), or an erasure of this caller removed this conversation (its id, without
a "#..." suffix, held in the tombstone KEYS[5]; nothing written), 5 the caller is a live alias (nothing written; the
array is {5, the profile's subject} then, and for an end a third element: 1 if the caller has a live record
of the conversation id, whose claim a cluster's service then keeps, else 0). An end that replays one applied
before the caller became an alias is still a replay (status 2): the replay check comes before the alias
check, the claim after it. The end of a conversation, once applied, returns {1, extra} only.

The conversation record is a hash {subject, fingerprint, extra, expires_at}, also expiring by itself then;
after an erasure of its caller, {erased = "1", expires_at} (erase.lua).
With analytics, extra is built here (see Store.end_conversation): {"hour", "first": null | {...}, "new"}.
The first-interaction record is a hash {conversation_id, hour, qa, handoff_reason, handoff_to, expires_at,
seen_hour, seen_day, seen_week, created_at} (created_at, ms, is missing from records of earlier releases: their
hour stands for it).

Errors: "CMCORRUPT ..." when a stored field cannot be read; "CMBADARG ..." when a packed argument is malformed.

Mirrors service/domain/fields.py: live = now < min(expires_at, written_at + ttl_ms[name] or 0);
ETag = '"' .. first 20 hex of sha1(concat over live names in byte order of name \n packed \n) .. '"'.
]]

local hash, index = KEYS[1], KEYS[2]
local now = tonumber(ARGV[1])
local member = ARGV[2]

-- The profile a live alias record names, or nil. Read here, in the caller's slot, so that no write to the
-- caller lands once it is an alias (link_alias.lua sets the record in the same slot).
local function profile_of()
  local alias = redis.call('GET', KEYS[3])
  if alias then
    local e, profile = string.match(alias, '^(%d+)|([^|]*)|')
    if e and tonumber(e) > now then
      return profile
    end
  end
  return nil
end

local pos = 3
local record = nil
if ARGV[pos] == 'R' then
  record = {
    subject = ARGV[pos + 1],
    fingerprint = ARGV[pos + 2],
    extra = ARGV[pos + 3],
    expires_at = ARGV[pos + 4],
    conversation_id = ARGV[pos + 5],
    made_at = tonumber(ARGV[pos + 6]),
    claim = ARGV[pos + 7],
    written_at = tonumber(ARGV[pos + 8]) or now,
  }
  pos = pos + 9
else
  pos = pos + 1
  local profile = profile_of()
  if profile then
    return {5, profile}
  end
end
local analytics = nil
if ARGV[pos] == 'A' then
  analytics = {
    hour = ARGV[pos + 1],
    day = ARGV[pos + 2],
    week = ARGV[pos + 3],
    qa = ARGV[pos + 4],
    handoff_reason = ARGV[pos + 5],
    handoff_to = ARGV[pos + 6],
    first_expires_at = ARGV[pos + 7],
    first_after = tonumber(ARGV[pos + 8]),
  }
  pos = pos + 9
else
  pos = pos + 1
end
local mode = ARGV[pos]
pos = pos + 1
local etags = {}
local count = tonumber(ARGV[pos])
pos = pos + 1
for _ = 1, count do
  etags[ARGV[pos]] = true
  pos = pos + 1
end
local ttl = {}
count = tonumber(ARGV[pos])
pos = pos + 1
for _ = 1, count do
  ttl[ARGV[pos]] = tonumber(ARGV[pos + 1])
  pos = pos + 2
end
local sets_count = tonumber(ARGV[pos])
local sets_start = pos + 1
local deletes_start = sets_start + 2 * sets_count

-- A field as {packed, expires_at as a decimal string (for PEXPIREAT and ZADD), expires_at, written_at}.
-- #include field.lua

local stored = {}
local raw = redis.call('HGETALL', hash)
for i = 1, #raw, 2 do
  local f = parse(raw[i + 1])
  if not f then
    return redis.error_reply('CMCORRUPT unreadable field in ' .. hash)
  end
  stored[raw[i]] = f
end

local function not_expired_reply(applied, fields)
  local out = {applied}
  for name, f in pairs(fields) do
    if f[3] > now then
      out[#out + 1] = name
      out[#out + 1] = f[1]
    end
  end
  return out
end

-- Python sorts names by code point, which is UTF-8 byte order. Lua's '<' on strings uses strcoll, and
-- redis-server calls setlocale(LC_COLLATE, ""), so under e.g. en_US.UTF-8 it would not match: compare bytes.
local function byte_less(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return #a < #b
end

if record then
  -- An erasure at or after the moment this write was made wins: the write must not bring the caller back.
  -- So does an erasure that removed this conversation (erase.lua keeps its id in the tombstone), whenever
  -- the end says it was made and under whichever record (a late end's, a takeover's).
  local base = string.match(record.conversation_id, '^[^#]+') or record.conversation_id
  local tomb = redis.call('HMGET', KEYS[5], 'erased_at', 'expires_at', 'c:' .. base)
  if tomb[1] and tonumber(tomb[2]) > now and tonumber(tomb[1]) >= record.made_at then
    return {4}
  end
  if tomb[3] and tonumber(tomb[3]) > now then
    return {4}
  end
  -- Live while its expires_at is after now (the service's clock); Redis also drops it then by itself.
  local seen = redis.call('HMGET', KEYS[4], 'subject', 'fingerprint', 'extra', 'expires_at', 'erased')
  -- An erasure removed what this conversation id wrote (erase.lua left a marker): whenever this write says
  -- it was made, it is a replay of an erased conversation and changes nothing.
  if seen[5] and tonumber(seen[4]) > now then
    return {4}
  end
  local live = seen[1] and tonumber(seen[4]) > now
  -- A replay of an end applied to this caller (before it became an alias, if it is one now) is answered as
  -- one, whatever the caller is now.
  if live and seen[1] == record.subject and seen[2] == record.fingerprint then
    return {2, seen[2], seen[3], seen[4]}
  end
  -- Before the claim: an end refused for an alias leaves no claim naming it. Any other record of the id is
  -- no replay, and not answered here either: the domain's retry on the profile decides (replay or conflict).
  local profile = profile_of()
  if profile then
    return {5, profile, live and 1 or 0}
  end
  -- After the erasure checks: a write refused for an erased caller leaves no claim naming them.
  if record.claim ~= '' then
    -- The id belongs to the caller that ended it first, until that conversation's record expires (by the
    -- service's clock: Redis's may lag behind it). An erasure turns the claim into "!|<expires_at>".
    local previous = redis.call('GET', KEYS[8])
    local owner, until_ms = nil, 0
    if previous then
      local o, u = string.match(previous, '^([^|]*)|(%d*)$')
      owner, until_ms = o, tonumber(u or '') or 0
    end
    if owner ~= record.subject then
      if previous and until_ms > now then
        if owner == '!' then
          return {4}
        end
        return {3}
      end
      redis.call('SET', KEYS[8], record.claim, 'PXAT', record.expires_at)
    end
  end
  if live then
    return {3} -- (a replay was answered above)
  end
end

if mode ~= '' then
  local live = {}
  for name, f in pairs(stored) do
    local limit = f[4] + (ttl[name] or 0)
    if f[3] < limit then
      limit = f[3]
    end
    if now < limit then
      live[#live + 1] = name
    end
  end
  local holds
  if mode == '*' then
    holds = #live > 0
  else
    table.sort(live, byte_less)
    local parts = {}
    for _, name in ipairs(live) do
      parts[#parts + 1] = name .. '\n' .. stored[name][1] .. '\n'
    end
    local etag = '"' .. string.sub(redis.sha1hex(table.concat(parts)), 1, 20) .. '"'
    holds = etags[etag] == true
  end
  if not holds then
    return not_expired_reply(0, stored)
  end
end

-- The memory after this write: stored fields minus the dead ones, minus the deletes, plus the sets (a name
-- in both is set, as in the SQLite backend).
local final = {}
for name, f in pairs(stored) do
  if f[3] > now then
    final[name] = f
  end
end
-- An end writes at its write time: a live field written after it is left as it is (an older state checkpoint
-- never overwrites a later write).
local function later(name)
  local f = stored[name]
  return record ~= nil and f ~= nil and f[3] > now and f[4] > record.written_at
end
for i = deletes_start, #ARGV do
  if not later(ARGV[i]) then
    final[ARGV[i]] = nil
  end
end
for i = sets_start, deletes_start - 1, 2 do
  local f = parse(ARGV[i + 1])
  if not f then
    return redis.error_reply('CMBADARG malformed packed field')
  end
  if later(ARGV[i]) then
    -- kept as stored
  elseif f[3] > now then
    final[ARGV[i]] = f
  else
    final[ARGV[i]] = nil -- dead on arrival: nothing to keep
  end
end

-- Write only the difference. Chunked: unpack() is limited by the Lua C stack.
local function call_chunked(command, args)
  for s = 1, #args, 1000 do
    redis.call(command, hash, unpack(args, s, math.min(s + 999, #args)))
  end
end
local removed, written = {}, {}
for name, _ in pairs(stored) do
  if not final[name] then
    removed[#removed + 1] = name
  end
end
local min_f, max_f
for name, f in pairs(final) do
  if not stored[name] or stored[name][1] ~= f[1] then
    written[#written + 1] = name
    written[#written + 1] = f[1]
  end
  if not min_f or f[3] < min_f[3] then
    min_f = f
  end
  if not max_f or f[3] > max_f[3] then
    max_f = f
  end
end
call_chunked('HDEL', removed)
call_chunked('HSET', written)

if not min_f then
  redis.call('DEL', hash)
  redis.call('ZREM', index, member)
else
  -- The whole hash dies at its latest field expiry even if no sweeper ever runs.
  redis.call('PEXPIREAT', hash, max_f[2])
  redis.call('ZADD', index, min_f[2], member)
end
-- An optional string travels as "" (none) or "=" and the value.
local function optional(v)
  if v == nil or v == false or v == '' then
    return cjson.null
  end
  return string.sub(v, 2)
end

if record and analytics then
  local f = redis.call('HMGET', KEYS[7], 'conversation_id', 'hour', 'qa', 'handoff_reason', 'handoff_to',
    'expires_at', 'seen_hour', 'seen_day', 'seen_week', 'created_at')
  local first = cjson.null
  local seen = {false, false, false}
  -- Live by its own expiry and by the project's current retention (which may have been shortened since).
  if f[1] and tonumber(f[6]) > now and tonumber(f[10] or f[2]) > analytics.first_after then
    first = {
      conversation_id = f[1],
      hour = tonumber(f[2]),
      qa = optional(f[3]),
      handoff_reason = optional(f[4]),
      handoff_to = optional(f[5]),
    }
    seen = {f[7], f[8], f[9]}
    redis.call('HSET', KEYS[7], 'seen_hour', analytics.hour, 'seen_day', analytics.day, 'seen_week', analytics.week)
  else
    redis.call('DEL', KEYS[7])
    redis.call('HSET', KEYS[7], 'conversation_id', record.conversation_id, 'hour', analytics.hour,
      'qa', analytics.qa, 'handoff_reason', analytics.handoff_reason, 'handoff_to', analytics.handoff_to,
      'expires_at', analytics.first_expires_at, 'seen_hour', analytics.hour, 'seen_day', analytics.day,
      'seen_week', analytics.week, 'created_at', now)
    redis.call('PEXPIREAT', KEYS[7], analytics.first_expires_at)
  end
  local new = {}
  local current = {analytics.hour, analytics.day, analytics.week}
  local kinds = {'hour', 'day', 'week'}
  for i = 1, 3 do
    if seen[i] ~= current[i] then
      new[#new + 1] = kinds[i]
    end
  end
  record.extra = cjson.encode({hour = tonumber(analytics.hour), first = first, new = table.concat(new, ',')})
end

if record then
  redis.call('HSET', KEYS[4], 'subject', record.subject, 'fingerprint', record.fingerprint, 'extra', record.extra,
    'expires_at', record.expires_at)
  redis.call('PEXPIREAT', KEYS[4], record.expires_at)
  -- Which conversations belong to the caller, so that an erasure can unlink them all.
  redis.call('SADD', KEYS[6], record.conversation_id)
  if tonumber(redis.call('PEXPIRETIME', KEYS[6])) < tonumber(record.expires_at) then
    redis.call('PEXPIREAT', KEYS[6], record.expires_at)
  end
end
if record then
  return {1, record.extra}
end
return not_expired_reply(1, final)
