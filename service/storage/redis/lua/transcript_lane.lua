--[[
transcript_lane.lua: keep a caller's conversation indexes, in the caller's slot (TranscriptStore.finish_end,
delete_conversation, channel_conversations, caller_conversations_page: redis_caller_index.py).

KEYS[1]  the caller's conversations  cm:{<bucket>}:vc:<project>:<subject>  conv_id -> horizon (the listing)
KEYS[2]  by start                    cm:{<bucket>}:vs:<project>:<subject>  conv_id -> started_at
KEYS[3]  by channel                  cm:{<bucket>}:vk:<project>:<subject>  lex, all scores 0:
                                     "<channel>\no<conv_id>" open or ending, "<channel>\nr<inverted last
                                     activity, 13 digits><conv_id>" resumable and ended
KEYS[4]  across channels             cm:{<bucket>}:va:<project>:<subject>  conv_id -> 2^53 - 1 (open or
                                     ending) or its last activity (resumable and ended)
ARGV: how many resumable ended conversations to keep per channel (and across channels), then operations of
five arguments each: the operation, the conversation id, its open member, its resumable member ("" if it is
not resumable), a score (its last activity, or its start time for "index"):

  "settle"  it ended: out of the open ones; among the newest resumable ones if it is resumable (trimmed to
            the number kept), else out of the indexes by channel
  "drop"    out of the indexes by channel (a stale entry, or a deleted conversation: then "unlist" too)
  "prune"   "drop", once it is off the listing (a conversation without a header: listed, not yet written)
  "unlist"  out of the listing by start
  "open"    among the open ones (an index made for a caller listed by an earlier release)
  "index"   into the listing by start, with its start time (likewise)

Every operation but "drop" and "unlist" needs the conversation still listed (KEYS[1]): one deleted or erased
meanwhile is not indexed again. A key made here expires with the listing. Returns the number of operations.
]]
local live = 9007199254740991
local kept = tonumber(ARGV[1])
local expiry = redis.call('PEXPIRETIME', KEYS[1])
local function trim(member)
  local channel = string.match(member, '^([^\n]*)\n')
  local last = '(' .. channel .. '\ns'
  local extra = redis.call('ZRANGE', KEYS[3], '[' .. channel .. '\nr', last, 'BYLEX', 'LIMIT', kept, 1)
  if extra[1] then
    redis.call('ZREMRANGEBYLEX', KEYS[3], '[' .. extra[1], last)
  end
  local ended = redis.call('ZCARD', KEYS[4]) - redis.call('ZCOUNT', KEYS[4], live, live)
  if ended > kept then
    redis.call('ZREMRANGEBYRANK', KEYS[4], 0, ended - kept - 1)
  end
end
local n = 0
for i = 2, #ARGV, 5 do
  local op, id, open, resumable, score = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local listed = redis.call('ZSCORE', KEYS[1], id)
  if op == 'drop' or (op == 'prune' and not listed) then
    redis.call('ZREM', KEYS[3], open)
    if resumable ~= '' then
      redis.call('ZREM', KEYS[3], resumable)
    end
    redis.call('ZREM', KEYS[4], id)
  elseif op == 'unlist' then
    redis.call('ZREM', KEYS[2], id)
  elseif listed and op == 'settle' then
    redis.call('ZREM', KEYS[3], open)
    if resumable ~= '' then
      redis.call('ZADD', KEYS[3], 0, resumable)
      redis.call('ZADD', KEYS[4], score, id)
      trim(resumable)
    else
      redis.call('ZREM', KEYS[4], id)
    end
  elseif listed and op == 'open' then
    redis.call('ZADD', KEYS[3], 0, open)
    redis.call('ZADD', KEYS[4], live, id)
  elseif listed and op == 'index' then
    redis.call('ZADD', KEYS[2], score, id)
  end
  n = n + 1
end
if expiry > 0 then
  for k = 2, 4 do
    if redis.call('PTTL', KEYS[k]) == -1 then
      redis.call('PEXPIREAT', KEYS[k], expiry)
    end
  end
end
return n
