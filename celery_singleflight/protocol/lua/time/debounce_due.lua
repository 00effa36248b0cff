-- DEBOUNCE_DUE: a debounced call's message came due (protocol/timing.py).
-- KEYS[1] - the key's open burst; KEYS[2] - its last closed burst (see DEBOUNCE_CALL)
-- ARGV[1] - the task id whose message came due
-- ARGV[2] - the leader its header names ('' if none: sent by name)
-- ARGV[3] - a token unique to this execution (a replay of this call carries the same one)
-- ARGV[4] - when the call was sent, ms ('' if unknown); a call no burst knows that was sent before
--           the first call of the open or the last closed burst is folded into that burst's run
--           (a re-sent message must not run older arguments after newer ones)
-- ARGV[5] - the call's arguments (JSON; '' to record nothing); ARGV[6] - 'last' or 'first'
--           (debounce_keep): a call its leader's open burst does not know (recorded again after
--           Redis lost it) joins it now, or opens it again for its leader, due ARGV[7] ms later
-- Another call waits DEBOUNCE_GRACE_MS past due for the leader to start; the leader goes ahead
-- DEBOUNCE_LEADER_EARLY_MS early (the broker's countdown timers are not exact).
-- return {RUN, payload, calls, first call ms, 1 if this execution closed the burst (also on a
--        replay) else 0 (another delivery of this task id closed it)}: this run goes ahead;
--        {WAIT, ms left, calls, due ms}: the burst is still open, come back when it is due (or,
--        for another call, the grace after that);
--        {FOLDED, the run's task id, calls}: the burst was run by another call;
--        {UNKNOWN}: no burst of that leader is known, nor a later one (record the call now)
local now = clock_ms()
local id, leader = ARGV[1], ARGV[2]
local c = redis.call('HMGET', KEYS[2], 'leader', 'ran', 'payload', 'count', 'first', 'ran_token')
if c[2] == id then
  return {RUN, c[3], tonumber(c[4]), tonumber(c[5]), c[6] == ARGV[3] and 1 or 0}
end
local b = redis.call('HMGET', KEYS[1], 'leader', 'due', 'payload', 'count', 'first', 'sent')
if leader ~= '' and b[1] == leader then
  local due = tonumber(b[2])
  if id ~= leader and ARGV[5] ~= '' and redis.call('HSETNX', KEYS[1], 'c:' .. id, 1) == 1 then
    b[4] = redis.call('HINCRBY', KEYS[1], 'count', 1)
    if ARGV[6] == 'last' then
      take_payload(KEYS[1], ARGV[5], ARGV[4], b[6])
      b[3] = redis.call('HGET', KEYS[1], 'payload')
    end
  end
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
local sent = tonumber(ARGV[4])
if sent and b[1] and tonumber(b[5]) > sent then
  return {FOLDED, b[1], tonumber(b[4])}
end
if sent and c[2] and tonumber(c[5]) > sent then
  return {FOLDED, c[2], tonumber(c[4])}
end
if leader ~= '' and leader ~= id then
  if b[1] or ARGV[5] == '' or not sent or now - sent > DEBOUNCE_CLOSED_KEEP_MS / 2 then
    return {FOLDED, leader, 0} -- its burst ran long ago (and was forgotten), or nothing says otherwise
  end
  -- sent lately, yet its leader's burst is gone: lost with the Redis data; this call opens it
  -- again, for its leader
  local due = now + tonumber(ARGV[7])
  redis.call('HSET', KEYS[1], 'leader', leader, 'first', ms_text(now), 'due', ms_text(due), 'count', 1,
    'c:' .. id, 1)
  take_payload(KEYS[1], ARGV[5], ARGV[4], nil)
  redis.call('PEXPIRE', KEYS[1], math.floor(due - now + DEBOUNCE_CLOSED_KEEP_MS))
  return {WAIT, due + DEBOUNCE_GRACE_MS - now, 1, due}
end
return {UNKNOWN}
