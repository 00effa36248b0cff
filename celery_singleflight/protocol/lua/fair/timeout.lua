-- FAIR_TIMEOUT: the runs that waited at a fair gate longer than their queue_timeout leave the
-- queue without running (protocol/fair.py); the caller ends each one FAILURE (QueueTimeout).
-- KEYS[1..n] - the gate's run records
-- KEYS[n+1] - the queue; KEYS[n+2] - parked messages; KEYS[n+3] - fair tags; KEYS[n+4] - fair
-- state; KEYS[n+5] - when each run parked; KEYS[n+6] - runs timed out, not yet ended
-- ARGV[1] - n; ARGV[2] - the queue_timeout (ms); ARGV[3] - the most runs to take
-- A run taken out is kept in KEYS[n+6] (task id -> 'ms waited|fair key') until its caller ended
-- it, so that a caller that dies in between leaves it to the next sweep.
-- Safe to run twice: a run taken out before is not in the queue any more.
-- return {task id, 'ms waited|fair key', ...} of every run timed out and not yet ended
local n = tonumber(ARGV[1])
local queue, parked, tags, state, since, out = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4],
  KEYS[n + 5], KEYS[n + 6]
local now = clock()
local due = redis.call('ZRANGEBYSCORE', since, '-inf', now - tonumber(ARGV[2]), 'WITHSCORES', 'LIMIT', 0,
  tonumber(ARGV[3]))
for i = 1, #due, 2 do
  local entry, at = due[i], tonumber(due[i + 1])
  local fair = unpark(n, queue, parked, tags, state, since, entry, now)
  if fair then
    redis.call('HSET', out, string.sub(entry, 1, string.find(entry, '|', 1, true) - 1), num(now - at) .. '|' .. fair)
  end
end
local found = {}
for _, v in ipairs(redis.call('HGETALL', out)) do
  table.insert(found, v)
end
return found
