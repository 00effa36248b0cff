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
-- return {NOTHING_WAITS}; {ALL_HELD, ms until a lease runs out or the pause ends} (check again then);
--        {MORE_SLOTS, slots} if the key's limits allow more slots than were named;
--        {HANDED_ON, reservation ms, message or '', orphaned joined runs...} if a slot was free;
--        {FOREIGN, version} if a record was written by another protocol version
local n, ttl, by = tonumber(ARGV[2]), tonumber(ARGV[1]), ARGV[3]
local queue, parked, joined, settled, marker = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4], KEYS[n + 5]
local recs = records(n)
for i = 1, n do
  if recs[i] and recs[i].reserved and recs[i].by == by then -- this call ran before
    return append({HANDED_ON, ttl, redis.call('HGET', parked, recs[i].task_id) or ''}, settled_for(settled, by))
  end
end
if redis.call('HEXISTS', settled, by) == 1 then
  return append({HANDED_ON, ttl, ''}, settled_for(settled, by))
end
if redis.call('LLEN', queue) == 0 and redis.call('LLEN', joined) == 0 then
  return {NOTHING_WAITS}
end
local version = foreign(recs, n)
if version then
  return {FOREIGN, version}
end
local now = clock()
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
local out = {HANDED_ON, ttl, ''}
if expired(recs[slot], now) then
  forget_dead(marker, recs[slot])
end
if slot == 1 then -- joined runs only exist with one slot: their holder is gone
  append(out, take_joined(joined, settled, by))
  if recs[1] and recs[1].joined then
    recs[1].joined = nil
    redis.call('SET', KEYS[1], cjson.encode(recs[1]), 'KEEPTTL')
  end
end
out[3] = hand_off(slot, n, recs, queue, parked, now, ttl, tonumber(ARGV[4]), by, false, marker) or ''
if out[3] == '' and #out == 3 then
  return {ALL_HELD, ttl}
end
return out
