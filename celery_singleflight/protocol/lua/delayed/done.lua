-- CLAIM_DONE: the run that claimed a delayed run's copy started (it is watched as started from
-- now on) or ended before it started (protocol/delayed.py): the copy is no longer needed.
-- KEYS[1] - the key's delayed runs (hash: task id -> entry)
-- KEYS[2] - when claimed entries may go (sorted set: task id -> ms)
-- KEYS[3] - the delayed index (sorted set), when it may be named here (not on a Cluster: the
--           caller then drops the run from it after a DONE)
-- ARGV[1] - the run's task id
-- ARGV[2] - the token of the claimant's copy
-- ARGV[3] - the run's member of the delayed index
-- A copy not claimed yet whose token is current is claimed and done at once (Redis lost the claim
-- and the recovery put the copy back). Once done, the entry goes, or, if other copies may still
-- come (a sweeper sent one, or the run was delayed before), stays without its message for
-- DELAYED_KEEP_MS, so that they are stale; and the run leaves the delayed index. A claim taken
-- back leaves the index as it is (the copy sent again is looked after there). Running it twice
-- answers the same.
-- return {DONE} (this run goes on; also when no entry is known), {TAKEN_BACK} (a sweeper took the
--        claim back and sent the copy again: this run must not start)
local id, token = ARGV[1], ARGV[2]
local function done()
  if KEYS[3] then
    redis.call('ZREM', KEYS[3], ARGV[3])
  end
  return {DONE}
end
local e = entry_of(KEYS[1], id)
if not e then
  return done()
end
if (e.c and e.c ~= token) or (not e.c and not has_token(e, token)) then
  return {TAKEN_BACK}
end
if not e.m then
  return done()
end
local now = clock()
prune(KEYS[1], KEYS[2], now)
if not e.r and not e.old then
  redis.call('HDEL', KEYS[1], id)
  return done()
end
e.c, e.m, e.w, e.h, e.o, e.lt, e.ca = token, nil, nil, nil, nil, nil, nil
redis.call('HSET', KEYS[1], id, cjson.encode(e))
redis.call('ZADD', KEYS[2], now + DELAYED_KEEP_MS, id)
keep_for(KEYS[1], DELAYED_KEEP_MS)
keep_for(KEYS[2], DELAYED_KEEP_MS)
return done()
