-- Naming a holder that died: a script that takes, hands on or reserves a slot in place of a run
-- whose lease ran out unreleased names that run in its reply (its caller ends it, RunLost), and
-- the new record keeps it (prev_worker, prev_task_name), so that a replay names it again.
--
-- the holder that died where the record ``r`` now is (its task id, worker, task name), or ''s
local function dead_named(r)
  if r and r.prev_worker then
    return r.prev_task_id or '', r.prev_worker, r.prev_task_name or ''
  end
  return '', '', ''
end
