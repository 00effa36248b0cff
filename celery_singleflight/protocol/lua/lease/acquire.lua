-- ACQUIRE's general path: a record the plain path does not read, several slots, a parked run
-- adopting the slot reserved for it, or an attempt whose reply was lost.
-- ``keep`` stays a string: only a hand-off does sums with it (Lua converts it there)
local keep, id, own = string.match(ARGV[1], ACQUIRE_REST)
ttl = tonumber(ttl)
local recs = records(n, 1, decode(first))
local now, now_us = clock()
local slot, waiting = nil, false
for i = 1, n do
  local r = recs[i]
  -- this call ran before and its reply was lost: answer as it did, with the lease counted from
  -- now (the caller starts its run only now; a reply held back long may find it run out)
  if r and r.token == token then
    if tonumber(r.deadline) < now + ttl then
      r.deadline = num(now + ttl)
      redis.call('SET', KEYS[i], cjson.encode(r), 'PX', px)
    end
    local got = r.fence .. ':' .. r.since .. ':' .. (i - 1)
    return r.prev_worker and {TOOK, got, dead_named(r)} or got -- a dead holder it replaced: named again
  end
  if r and r.reserved and r.by == token then -- the dead holder it handed on: named again
    local msg = redis.call('HGET', parked, r.task_id) or ''
    return {HANDED_ON, r.task_id, math.max(tonumber(r.deadline) - now, 0), msg, dead_named(r)}
  end
  waiting = waiting or (r and r.waiting)
end
-- after the replays above (they read only what this call wrote): another slot may have been
-- taken by a worker of another version since
local version = foreign(recs, n)
if version then
  return {FOREIGN, version}
end
for i = 1, n do
  local r = recs[i]
  if r and r.token and ((handoff ~= '' and r.token == handoff and r.reserved)
      or (earlier ~= '' and r.token == earlier)) then
    slot = i -- the reservation made for this run, or this run's own earlier attempt
    break
  end
end
local adopting = slot ~= nil
if handoff ~= '' and (taken_before(adopted, handoff, recs, n, now)
    or (adopting and holds_elsewhere(adopted, handoff, recs, n, slot, now))) then
  return {ADOPTED} -- this parked run took its slot (and ran, or runs): a copy must not run it again
end
local _, want = slot_limits(limits, n)
if want > n then
  return {MORE_SLOTS, want} -- its limits were raised: every slot that may hold a run must be named
end
if not slot then
  local holder, left, held_at, pause = nil, nil, nil, paused_left(paused, now)
  if pause then
    return {PAUSED, pause} -- no grant while paused (a reservation made before is adopted above)
  end
  waiting = waiting or (paused and redis.call('LLEN', queue) > 0) -- a pause just over: parked runs first
  slot, holder, left, held_at = scan(recs, n, now)
  if slot and not below_limit(limits, tonumber(own), recs, n, now) then
    slot = nil -- its concurrency, set at run time (or the task's, on more slots the limits named)
  end
  if n > 1 and id ~= '' then
    -- a task id already running on one slot (a redelivery) must not take another
    for i = 1, n do
      if live(recs[i], now) and recs[i].task_id == id then
        return {HELD, id, tonumber(recs[i].deadline) - now, recs[i].trace or ''}
      end
    end
  end
  if not slot then
    -- the holder's trace context ('' if it was not traced): the duplicate's span links to it
    return {HELD, holder, left, held_at and recs[held_at].trace or ''}
  end
  if waiting then
    local mine = handoff ~= '' and id .. '|' .. handoff
    local msg = hand_off(slot, n, recs, queue, parked, now, ttl, keep, token, mine, marker)
    if msg then
      -- the reservation names a holder that died there: the caller ends its run
      return {HANDED_ON, recs[slot].task_id, ttl, msg, dead_named(recs[slot])}
    end
    waiting = redis.call('LLEN', queue) > 0
  end
end
if handoff ~= '' then
  -- leaving the queue: this run's entry and message; its token is remembered, so that another
  -- copy of its message does not run it again
  redis.call('LREM', queue, 1, id .. '|' .. handoff)
  redis.call('HDEL', parked, id)
  waiting = redis.call('LLEN', queue) > 0
end
local prev = recs[slot]
local fence = num(next_fence(recs, n, now_us))
if handoff ~= '' then
  -- remembered by its fence (a clock in microseconds): a later copy of its message learns
  -- whether this run lost its lease (then it runs again, as a redelivery would) or not
  redis.call('ZREMRANGEBYSCORE', adopted, '-inf', now_us - ADOPTED_KEEP_MS * 1000)
  redis.call('ZADD', adopted, fence, handoff)
  redis.call('PEXPIRE', adopted, ADOPTED_KEEP_MS)
end
local extra, lost, carried, dead = carried_over(prev, now, adopting, marker, id, handoff ~= '')
if waiting then
  extra = extra .. WAITING_FLAG
end
local since, deadline = num(now), num(now + ttl)
-- The lease fields first, in the order of RUNNING_RECORD, then ``rt`` and ``lost`` if set, then
-- the holder (its task id first) and its trace context. A plain run's record (nobody joined or
-- waiting, not superseded) opens with PLAIN: only a record this line wrote (and RENEW kept) has
-- it, and RELEASE may read it as text.
local open = (prev and prev.joined or carried ~= '' or waiting) and '{' or PLAIN
local rt = prev and prev.rt and prev.rt ~= '' and RT_FIELD(prev.rt) or ''
if lost ~= '' then
  rt = rt .. LOST_FIELD(lost)
end
redis.call('SET', KEYS[slot], RUNNING_RECORD(open, token, fence, since, deadline) .. rt .. ARGV[2] .. trace ..
  extra .. carried .. '}', 'PX', px)
if dead then -- its lease ran out unreleased: the caller ends its run
  return {TOOK, fence .. ':' .. since .. ':' .. (slot - 1), dead.task_id or '', dead.worker or '',
    dead.task_name or ''}
end
return fence .. ':' .. since .. ':' .. (slot - 1)
