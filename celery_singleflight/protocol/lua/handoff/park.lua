-- PARK: a duplicate waits in the key's FIFO (``queue``; protocol/handoff.py).
-- KEYS[1..n] - the key's run records
-- KEYS[n+1] - queue of parked runs
-- KEYS[n+2] - parked messages
-- KEYS[n+3] - hand-off tokens of parked runs that took their slot (ADOPTED)
-- KEYS[n+4] - the key's pause (controls): while it lasts a run parks, free slot or not
-- KEYS[n+5] - the journal marks of runs waiting on the key (protocol/epoch.py)
-- ARGV[1] - the entry 'task id|handoff token'
-- ARGV[2] - the message to send when it is its turn
-- ARGV[3] - the most runs that may wait (-1: no limit)
-- ARGV[4] - n, the number of slots
-- ARGV[5] - the run's journal mark ('' if it is not journaled)
-- An own copy (its token starts with OWN_COPY: a turned-away redelivery of the holder's own run)
-- waits at the front, beyond any limit, and only runs if that run's lease ends without a release
-- (RELEASE drops it); it is parked only while that run holds a slot (else FREE: not run); an entry already parked under its task id is kept as it is, so a second run
-- of the same call parks nothing more.
-- Every held record is flagged ``waiting``, so its release hands the key on.
-- return {FREE} if a slot is free (acquire again), {QUEUE_FULL, length} if the queue is full,
--        {PARKED, position, ms until the first holder's lease runs out (or the pause ends)} once parked
local n = tonumber(ARGV[4])
local queue, parked, adopted = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
local sep = string.find(ARGV[1], '|', 1, true)
local id, token = string.sub(ARGV[1], 1, sep - 1), string.sub(ARGV[1], sep + 1)
local own = is_own_copy(token)
local now = clock()
-- a second run of this call whose first run parked the run, which may have been handed the key
-- and taken it since (its token is then adopted): it answers PARKED, never FREE, so that the
-- caller does not run it a second time
if redis.call('ZSCORE', adopted, token) or (not own and redis.call('HGET', parked, id)) then
  local _, _, ms_left = scan(records(n), n, now)
  local found = redis.call('LPOS', queue, ARGV[1])
  return {PARKED, found and found + 1 or 1, math.max(ms_left, 0)}
end
local recs, left = all_held(n, now)
local pause = paused_left(redis.call('GET', KEYS[n + 4]), now)
if pause and not own then
  recs, left = records(n), pause_look(pause) -- the sweeper looks again when the pause ends
elseif not recs then
  return {FREE}
end
if own then -- only while its run holds a slot: once that run ended (this call sent again after
  local holds = false -- its release dropped the copy), a copy would run it again
  for i = 1, n do
    holds = holds or (recs[i].task_id == id and not recs[i].reserved)
  end
  if not holds then
    return {FREE}
  end
end
local length = redis.call('LLEN', queue)
local position = own and 1 or length + 1
if not redis.call('HGET', parked, id) then
  if not own and tonumber(ARGV[3]) >= 0 and length >= tonumber(ARGV[3]) then
    return {QUEUE_FULL, length}
  end
  if own then
    redis.call('LPUSH', queue, ARGV[1])
  else
    redis.call('RPUSH', queue, ARGV[1])
  end
  redis.call('HSET', parked, id, ARGV[2])
  journaled(KEYS[n + 5], ARGV[5], now)
elseif not own then
  local found = redis.call('LPOS', queue, ARGV[1])
  position = found and found + 1 or length
end
for i = 1, n do
  if recs[i] and not recs[i].waiting then
    recs[i].waiting = '1'
    redis.call('SET', KEYS[i], cjson.encode(recs[i]), 'KEEPTTL')
  end
end
return {PARKED, position, left}
