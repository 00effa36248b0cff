-- REVISE_OUTCOME: correct the outcome a run recorded itself once more is known (protocol/lease.py):
-- the worker's main process knows a run that said "terminated" was revoked; a run that released
-- as "retried" learns no retry was sent, so it "failed".
-- KEYS[1] - run record of the key's slot
-- ARGV[1] - task id of the run
-- ARGV[2] - the outcome recorded by the run itself (e.g. terminated)
-- ARGV[3] - the outcome now known (e.g. revoked)
-- return REVISED (also when revised before), or NOT_REVISED if the record is not that run's or
-- says something else. The run's own record comes first (a retried task's next attempt has the
-- same task id); else its outcome is the ``prev_outcome`` of a run the key was handed to meanwhile.
local r = decode(redis.call('GET', KEYS[1]))
if not r then
  return NOT_REVISED
end
if r.task_id == ARGV[1] and not r.token then
  if r.outcome == ARGV[3] then
    return REVISED
  end
  if r.outcome == ARGV[2] then
    r.state, r.outcome = ARGV[3], ARGV[3]
    redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
    return REVISED
  end
end
if r.prev_task_id == ARGV[1] then
  if r.prev_outcome == ARGV[3] then
    return REVISED
  end
  if r.prev_outcome == ARGV[2] then
    r.prev_outcome = ARGV[3]
    redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
    return REVISED
  end
end
return NOT_REVISED
