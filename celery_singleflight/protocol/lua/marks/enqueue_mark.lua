-- ENQUEUE_MARK: claim the key for a task about to be sent (``dedup_enqueue``; protocol/marks.py).
-- KEYS[1] - enqueue-time dedup marker of the key
-- KEYS[2..n+1] - the key's run records
-- ARGV[1] - the task id about to be sent
-- ARGV[2] - marker TTL, milliseconds (a safety net if the message is lost)
-- return the task id already queued or running for the key, or false if ARGV[1] may be sent
-- (also when this call ran before and set the marker itself). A marker whose run is over (its
-- record ended, or its lease ran out unreleased: its worker died) no longer counts; a run that
-- ended to retry is not over: its retry is queued under the same task id.
local existing = redis.call('GET', KEYS[1])
if existing and existing ~= ARGV[1] then
  local now = nil
  for i = 2, #KEYS do
    local r = decode(redis.call('GET', KEYS[i]))
    if r and r.task_id == existing then
      now = now or clock()
      if live(r, now) or r.outcome == 'retried' then
        return existing
      end
      now = -1 -- its run is over
    end
  end
  if now ~= -1 then
    return existing -- still queued: no run of it has started
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
