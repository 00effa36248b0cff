-- JOIN: a duplicate waits for the holder's result (``join``; protocol/handoff.py).
-- KEYS[1] - run record of the key
-- KEYS[2] - runs joined to the holder's run
-- ARGV[1] - the joining run's message (it gets the holder's result); added once, however often
--           this runs
-- return {FREE} if the key is free (acquire again), else {JOINED, number joined, holder task id,
--        ms until the holder's lease runs out}
local r = decode(redis.call('GET', KEYS[1]))
local now = clock()
if not live(r, now) then
  return {FREE}
end
if not redis.call('LPOS', KEYS[2], ARGV[1]) then
  redis.call('RPUSH', KEYS[2], ARGV[1])
end
if not r.joined then
  r.joined = '1'
  redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
end
return {JOINED, redis.call('LLEN', KEYS[2]), r.task_id or '', tonumber(r.deadline) - now}
