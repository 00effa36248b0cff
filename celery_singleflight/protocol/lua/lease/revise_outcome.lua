-- REVISE_OUTCOME: the worker's main process corrects the outcome a run recorded itself
-- (terminated -> revoked; protocol/lease.py).
-- KEYS[1] - run record of the key
-- ARGV[1] - task id of the run
-- ARGV[2] - the outcome recorded by the run itself (e.g. terminated)
-- ARGV[3] - the outcome the worker's main process knows (e.g. revoked)
-- return REVISED (also when revised before), or NOT_REVISED if the record is not that run's or
-- says something else (the run's outcome is also the ``prev_outcome`` of a run the key was
-- handed to meanwhile)
local r = decode(redis.call('GET', KEYS[1]))
if r and r.prev_task_id == ARGV[1] and r.prev_outcome == ARGV[2] then
  r.prev_outcome = ARGV[3]
  redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
  return REVISED
end
if not r or r.task_id ~= ARGV[1] or r.token then
  return NOT_REVISED
end
if r.outcome == ARGV[3] then
  return REVISED
end
if r.outcome ~= ARGV[2] then
  return NOT_REVISED
end
r.state, r.outcome = ARGV[3], ARGV[3]
redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
return REVISED
