-- DEBOUNCE_DUE: a debounced call's message came due (protocol/timing.py).
-- KEYS[1] - the key's open burst; KEYS[2] - its last closed burst (see DEBOUNCE_CALL)
-- ARGV[1] - the task id whose message came due
-- ARGV[2] - the leader its header names ('' if none: sent by name)
-- ARGV[3] - a token unique to this execution (a replay of this call carries the same one)
-- Another call waits DEBOUNCE_GRACE_MS past due for the leader to start; the leader goes ahead
-- DEBOUNCE_LEADER_EARLY_MS early (the broker's countdown timers are not exact).
-- return {RUN, payload, calls, first call ms, 1 if this execution closed the burst (also on a
--        replay) else 0 (another delivery of this task id closed it)}: this run goes ahead;
--        {WAIT, ms left, calls, due ms}: the burst is still open, come back when it is due (or,
--        for another call, the grace after that);
--        {FOLDED, the run's task id, calls}: the burst was run by another call;
--        {UNKNOWN}: no burst of that leader is known (record the call now)
local now = clock_ms()
local id, leader = ARGV[1], ARGV[2]
local c = redis.call('HMGET', KEYS[2], 'leader', 'ran', 'payload', 'count', 'first', 'ran_token')
if c[2] == id then
  return {RUN, c[3], tonumber(c[4]), tonumber(c[5]), c[6] == ARGV[3] and 1 or 0}
end
local b = redis.call('HMGET', KEYS[1], 'leader', 'due', 'payload', 'count', 'first')
if leader ~= '' and b[1] == leader then
  local due = tonumber(b[2])
  if (id == leader and now >= due - DEBOUNCE_LEADER_EARLY_MS) or (id ~= leader and now >= due + DEBOUNCE_GRACE_MS) then
    redis.call('HSET', KEYS[1], 'ran', id, 'ran_at', ms_text(now), 'ran_token', ARGV[3])
    redis.call('RENAME', KEYS[1], KEYS[2])
    redis.call('PEXPIRE', KEYS[2], DEBOUNCE_CLOSED_KEEP_MS)
    return {RUN, b[3], tonumber(b[4]), tonumber(b[5]), 1}
  end
  if id == leader then
    return {WAIT, due - now, tonumber(b[4]), due}
  end
  return {WAIT, due + DEBOUNCE_GRACE_MS - now, tonumber(b[4]), due}
end
if leader ~= '' and c[1] == leader then
  return {FOLDED, c[2], tonumber(c[4])}
end
if leader ~= '' and leader ~= id then
  return {FOLDED, leader, 0}
end
return {UNKNOWN}
