-- FORCE_RELEASE: an operator frees one slot of a key whoever holds it (protocol/handoff.py).
-- KEYS[1..n] - the key's run records
-- KEYS[n+1] - the history stream of the released slot
-- KEYS[n+2] - queue of parked runs
-- KEYS[n+3] - parked messages
-- KEYS[n+4] - runs joined to the holder's run
-- KEYS[n+5] - what earlier calls handed over (hash: call id -> joined messages)
-- ARGV[1] - who asked (recorded in the status; also this call's id)
-- ARGV[2] - how long the record outlives the release, milliseconds
-- ARGV[3] - history length cap
-- ARGV[4] - the holder task id the operator saw ('' to release whoever holds it)
-- ARGV[5] - the slot to release (1-based)
-- ARGV[6] - n, the number of slots
-- ARGV[7] - lease TTL for a handoff reservation, milliseconds
-- ARGV[8] - '1' if the caller carries out the hand-on (sends the message, answers the joined
--           runs); '0' leaves both to the sweeper
-- ARGV[9] - this call's id (unique to it: a replay carries it): the released record's ``rt``, the
--           reservation's ``by``, and the joined runs it took under ``settled``
-- return {NOT_HELD} if the slot was free (or held by another); {FOREIGN, version} if its record
--        was written by another protocol version; else {FORCE_RELEASED, released task id, its
--        fence, message of the parked run now handed the key or '', joined run messages...}
local n, slot, by, call = tonumber(ARGV[6]), tonumber(ARGV[5]), ARGV[1], ARGV[9]
local history, queue, parked = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
local joined, settled = KEYS[n + 4], KEYS[n + 5]
local keep = math.max(tonumber(ARGV[2]), 1000)
local r = decode(redis.call('GET', KEYS[slot]))
-- this call ran before: answer as it did (the slot it freed, or the reservation it made there
-- for a parked run, which keeps the released run's id and fence)
if r and not r.token and r.rt == call then
  return append({FORCE_RELEASED, r.task_id or '', r.fence or '0', ''}, settled_for(settled, call))
end
if r and r.reserved and r.by == call then
  local msg = redis.call('HGET', parked, r.task_id) or ''
  return append({FORCE_RELEASED, r.prev_task_id or '', r.fence or '0', msg}, settled_for(settled, call))
end
if not (r and r.token) or (ARGV[4] ~= '' and r.task_id ~= ARGV[4]) then
  return {NOT_HELD}
end
local version = foreign({r}, 1)
if version then
  return {FOREIGN, version}
end
local now = clock()
tell_holder(KEYS[slot], r, TOLD_RELEASED .. '\31' .. by)
if not r.reserved then
  r.lost = add_lost(r.lost, r.fence) -- its holder's late release must learn it lost the key
end
r.token, r.deadline, r.reserved, r.by, r.rt, r.v = nil, nil, nil, nil, call, PROTOCOL
r.state, r.outcome, r.released_by = 'force-released', 'force-released', by
r.ended, r.updated = num(now), num(now)
history_end(r, history, ARGV[3], keep, now, {'by', by}, true)
local out = {FORCE_RELEASED, r.task_id or '', r.fence or '0', ''}
local hand_on = ARGV[8] == '1'
if hand_on and slot == 1 and r.joined then
  append(out, take_joined(joined, settled, call))
  r.joined = nil
end
redis.call('SET', KEYS[slot], cjson.encode(r), 'PX', keep)
if hand_on and r.waiting then
  out[4] = hand_off(slot, n, records(n, slot, r), queue, parked, now, tonumber(ARGV[7]), keep, call) or ''
end
return out
