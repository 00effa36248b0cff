-- CLAIM: a delayed run's message starts (protocol/delayed.py): does this copy run?
-- KEYS[1] - the key's delayed runs (hash: task id -> entry)
-- KEYS[2] - when claimed entries may go (sorted set: task id -> ms)
-- ARGV[1] - the run's task id
-- ARGV[2] - the token this copy carries
-- The first copy of the run's current delay to start claims it; every other copy, and any copy
-- of an earlier delay, is stale. Normally only the countdown message exists and the entry is
-- dropped; once other copies may come (a sweeper sent one, or the run was delayed before), the
-- claimed entry is kept, without its message, for DELAYED_KEEP_MS.
-- return {GO} (run it; also when no entry is known: Redis lost it, or it ran out), {GO_LATE} (run
--        it: a sweeper sent a copy, so it is late), {STALE} (another copy runs or ran: drop this
--        one); a second run of a claim answers as the first
local id, token = ARGV[1], ARGV[2]
local e = entry_of(KEYS[1], id)
if not e then
  return {GO}
end
local late = e.r and GO_LATE or GO
if e.c then
  return {e.c == token and late or STALE}
end
if not has_token(e, token) then
  return {STALE}
end
local now = clock()
prune(KEYS[1], KEYS[2], now)
if not e.r and not e.old then
  redis.call('HDEL', KEYS[1], id)
  return {GO}
end
e.c, e.m, e.w, e.h = token, nil, nil, nil
redis.call('HSET', KEYS[1], id, cjson.encode(e))
redis.call('ZADD', KEYS[2], now + DELAYED_KEEP_MS, id)
keep_for(KEYS[1], DELAYED_KEEP_MS)
keep_for(KEYS[2], DELAYED_KEEP_MS)
return {late}
