-- PROGRESS: an owner-checked status update and a history entry (protocol/lease.py).
-- KEYS[1] - run record
-- KEYS[2] - history stream
-- ARGV[1] - token of the run
-- ARGV[2] - history length cap
-- ARGV[3] - the update as JSON (stored in the history entry and in the record)
-- ARGV[4] - the update's state
-- ARGV[5] - the update's number in this run (1, 2, ...): a second run of the same call writes nothing
-- ARGV[6] - the run's arguments as canonical JSON ('' unless the task opts in)
-- ARGV[7] - how long the record outlives its lease, milliseconds
-- return {WRITTEN, history entry id}; {NOT_OURS} if the lease is not this run's; or
--        {WRITTEN_SUPERSEDED, task id} if a newer run took over (the update is written all the same)
local r = decode(redis.call('GET', KEYS[1]))
if not (r and r.token == ARGV[1]) then
  return {NOT_OURS}
end
if tonumber(r.pseq or '0') >= tonumber(ARGV[5]) then
  return progress_answer(r, r.entry or '0-0')
end
local now = clock()
if not r.history then
  redis.call('DEL', KEYS[2]) -- an earlier run's entries
  r.history = '1'
end
r.state, r.progress, r.updated, r.pseq = ARGV[4], ARGV[3], num(now), ARGV[5]
if ARGV[6] ~= '' then
  r.args = ARGV[6]
end
r.entry = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'kind', 'progress', 'fence', r.fence,
  'ts', num(now), 'data', ARGV[3])
redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
redis.call('PEXPIRE', KEYS[2], tonumber(r.deadline) - now + tonumber(ARGV[7]))
return progress_answer(r, r.entry)
