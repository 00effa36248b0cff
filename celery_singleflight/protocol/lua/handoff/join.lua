-- JOIN: a duplicate waits for the holder's result (``join``; protocol/handoff.py).
-- KEYS[1] - run record of the key
-- KEYS[2] - runs joined to the holder's run
-- KEYS[3] - what releases handed over (hash: release token -> joined messages)
-- KEYS[4] - the journal marks of runs waiting on the key (protocol/epoch.py)
-- ARGV[1] - the joining run's message (it gets the holder's result); added once, however often
--           this runs
-- ARGV[2] - the run's journal mark ('' if it is not journaled)
-- return {FREE} if the key is free (acquire again), else {JOINED, number joined, holder task id,
--        ms until the holder's lease runs out (0 once it ended)}
-- A second run of a call whose first run joined answers JOINED, adding nothing, even if the
-- holder ended in between: the message still waits in the joined list (a lease that ran out: the
-- sweeper answers it), or a release or a sweep took it (marked ANSWERED in ``settled``: that
-- release answers it), also when other runs took the key since
local r = decode(redis.call('GET', KEYS[1]))
local now = clock()
local held = live(r, now)
local before = redis.call('LPOS', KEYS[2], ARGV[1])
  or redis.call('HEXISTS', KEYS[3], ANSWERED .. redis.sha1hex(ARGV[1])) == 1
if not held and not before then
  return {FREE}
end
if not before then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  journaled(KEYS[4], ARGV[2], now)
end
if held and not r.joined then
  r.joined = '1'
  redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
end
return {JOINED, redis.call('LLEN', KEYS[2]), r and r.task_id or '', held and tonumber(r.deadline) - now or 0}
