-- CLAIM: a delayed run's message starts (protocol/delayed.py): does this copy run?
-- KEYS[1] - the key's delayed runs (hash: task id -> entry)
-- KEYS[2] - when claimed entries may go (sorted set: task id -> ms)
-- ARGV[1] - the run's task id
-- ARGV[2] - the token this copy carries
-- ARGV[3] - the claimant: its worker (node and instance), which a sweeper checks is alive
-- ARGV[4] - the token the claimant's lease will have (a copy sent again takes that lease over)
-- The first copy of the run's current delay to start claims it; every other copy, and any copy
-- of an earlier delay, is stale. The claim keeps the copy (its message) until the claimant says
-- it started or ended (CLAIM_DONE): should the claimant's worker die before that, a sweeper
-- takes the claim back and sends the copy again (RESEND).
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
  if e.c == token then
    return {late}
  end
  if has_token(e, token) then -- this copy is dropped: a late TOUCH of it must not hold the run
    make_stale(e, token)
    redis.call('HSET', KEYS[1], id, cjson.encode(e))
  end
  return {STALE}
end
if not has_token(e, token) then
  return {STALE}
end
e.c, e.o, e.lt, e.ca, e.w, e.took = token, ARGV[3], ARGV[4], num((clock())), nil, nil
redis.call('HSET', KEYS[1], id, cjson.encode(e))
return {late}
