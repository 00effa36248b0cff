-- RESUME: the sweeper's look at a key with waiting runs (protocol/handoff.py): a slot freed
-- without a hand-on (its holder died) goes to the first parked run, and runs joined to a gone
-- holder are handed back.
-- KEYS[1..n] - the key's run records
-- KEYS[n+1] - queue of parked runs
-- KEYS[n+2] - parked messages
-- KEYS[n+3] - runs joined to the holder's run
-- KEYS[n+4] - what earlier calls handed over (hash: call id -> joined messages)
-- KEYS[n+5] - enqueue-time dedup marker (a dead holder's is removed)
-- KEYS[n+6] - the key's pause (controls): nothing is handed on while it lasts
-- KEYS[n+7] - the key's limits (controls): a slot is handed on only below its concurrency
-- ARGV[1] - lease TTL for a handoff reservation, milliseconds
-- ARGV[2] - n, the number of slots
-- ARGV[3] - a call id unique to this check (a second run of it answers the same)
-- ARGV[4] - how long a record outlives its lease, milliseconds
-- return {NOTHING_WAITS, ms until a live lease runs out or -1, k, then the task id, worker and
--        task name of each of the k runs whose lease ran out unreleased on a slot of the key}
--        (look again then if a lease is live: its holder may die too); {ALL_HELD, ms until a
--        lease runs out or the pause ends} (check again then);
--        {MORE_SLOTS, slots} if the key's limits allow more slots than were named;
--        {HANDED_ON, reservation ms, message or '', k, then the task id, worker and task name of
--        each of the k runs whose lease ran out unreleased on a slot of the key, orphaned joined
--        runs...} if a slot was free (the caller sends the message, ends the dead runs, answers
--        the joined ones);
--        {FOREIGN, version} if a record was written by another protocol version
local n, ttl, by = tonumber(ARGV[2]), tonumber(ARGV[1]), ARGV[3]
local queue, parked, joined, settled, marker = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4], KEYS[n + 5]
local recs, now = records(n), clock()
-- the answer for a hand-on of ``msg`` on the slot now reserved as ``res``: every holder that died
-- on the key is named, the one whose slot was handed on (the reservation keeps it) and any other
-- (runs waited on the key: each is ended, not only the one whose slot was handed first)
-- every holder whose lease ran out unreleased on a slot of the key, but ``except`` (task id, worker,
-- task name each), after ``dead``
local function dead_on_key(dead, except)
  for i = 1, n do
    local r = recs[i]
    if expired(r, now) and r.task_id and r.task_id ~= except then
      append(dead, {r.task_id, r.worker or '', r.task_name or ''})
    end
  end
  return dead
end
local function handed(msg, res)
  local id, worker, task = dead_named(res)
  local dead = dead_on_key(worker ~= '' and {id, worker, task} or {}, id)
  return append({HANDED_ON, ttl, msg, #dead / 3}, dead)
end
for i = 1, n do
  if recs[i] and recs[i].reserved and recs[i].by == by then -- this call ran before
    return append(handed(redis.call('HGET', parked, recs[i].task_id) or '', recs[i]), settled_for(settled, by))
  end
end
if redis.call('HEXISTS', settled, by) == 1 then
  return append(handed('', nil), settled_for(settled, by))
end
if redis.call('LLEN', queue) == 0 and redis.call('LLEN', joined) == 0 then
  -- runs waited on the key (it is in the waiting index): a holder that died meanwhile is named
  -- once its lease ran out, also after they all went on through another slot (it ends RunLost),
  -- and while a lease is live the key is looked at again when it would run out
  local dead = dead_on_key({}, nil)
  local _, _, left = scan(recs, n, now) -- the first live lease's ms left, -1 if none
  return append({NOTHING_WAITS, left, #dead / 3}, dead)
end
local version = foreign(recs, n)
if version then
  return {FOREIGN, version}
end
local pause = paused_left(redis.call('GET', KEYS[n + 6]), now)
if pause then
  return {ALL_HELD, pause_look(pause)} -- look again when the pause ends (resume looks at once)
end
local limits = redis.call('GET', KEYS[n + 7])
local _, want = slot_limits(limits, n)
if want > n then
  return {MORE_SLOTS, want}
end
local slot, _, left = scan(recs, n, now)
if slot and not below_limit(limits, n, recs, n, now) then
  slot = nil
end
if not slot then
  return {ALL_HELD, math.max(left, 0)}
end
for i = 1, n do
  if recs[i] and recs[i].reserved and not live(recs[i], now) then
    slot = i -- a reservation that ran out (its message slow, or lost with its sender): its run waits
    break    -- for this slot and no other, so it is handed this one again
  end
end
if expired(recs[slot], now) then
  forget_dead(marker, recs[slot])
end
local taken = {}
if slot == 1 then -- joined runs only exist with one slot: their holder is gone
  taken = take_joined(joined, settled, by)
  if recs[1] and recs[1].joined then
    recs[1].joined = nil
    redis.call('SET', KEYS[1], cjson.encode(recs[1]), 'KEEPTTL')
  end
end
local msg = hand_off(slot, n, recs, queue, parked, now, ttl, tonumber(ARGV[4]), by, false, marker)
if not msg and #taken == 0 then
  return {ALL_HELD, ttl}
end
return append(handed(msg or '', msg and recs[slot] or nil), taken)
