-- FAIR_ENTER: a run of a fair-share task arrives (protocol/fair.py). It may start if a slot of
-- its task's gate is free and nobody waits: the slot is then reserved for it (its token), and it
-- adopts the reservation when it takes the gate. Else it waits in the gate's queue, at its fair
-- place, until a release hands it a slot (the queue machinery of protocol/handoff.py).
-- KEYS[1..n] - the gate's run records
-- KEYS[n+1] - the queue; KEYS[n+2] - parked messages; KEYS[n+3] - adopted tokens
-- KEYS[n+4] - fair tags; KEYS[n+5] - fair state; KEYS[n+6] - weights set at run time
-- KEYS[n+7] - recent run times; KEYS[n+8] - when each waiting run parked
-- KEYS[n+9] - the journal marks of runs waiting on the gate (protocol/epoch.py)
-- ARGV[1] - the entry 'task id|token'; ARGV[2] - the message to send when it is its turn
-- ARGV[3] - n; ARGV[4] - the lease TTL (ms); ARGV[5] - how long a record is kept (ms)
-- ARGV[6] - the fair key; ARGV[7] - its weight (the task's); ARGV[8] - '1': only say what would
-- happen (a slot free is still reserved); ARGV[9] - the run's journal mark ('' if none)
-- Safe to run twice: a run whose token holds a slot or is parked answers as before.
-- return {ADMITTED, slot, and the task id, worker and task name of a run whose lease ran out
--        unreleased on that slot, or ''} (slot -1: it took a slot before; ACQUIRE decides about
--        a copy),
--        {PARKED, position, n, mean run ms, ms until the first lease runs out (-1: none held),
--        elapsed ms of each holder...} (or WOULD_PARK)
local n = tonumber(ARGV[3])
local queue, parked, adopted = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
local tags, state, weights, times, since = KEYS[n + 4], KEYS[n + 5], KEYS[n + 6], KEYS[n + 7], KEYS[n + 8]
local entry, fair = ARGV[1], ARGV[6]
local sep = string.find(entry, '|', 1, true)
local id, token = string.sub(entry, 1, sep - 1), string.sub(entry, sep + 1)
local now = clock()
local recs = records(n)
local free, _, left = scan(recs, n, now)
local function waiting(code, position)
  local out = {code, position, n, mean_time(times), left}
  for i = 1, n do
    if live(recs[i], now) and not recs[i].reserved then
      table.insert(out, now - tonumber(recs[i].since))
    end
  end
  return out
end
for i = 1, n do
  local r = recs[i]
  if r and r.token == token and (live(r, now) or r.reserved) then
    if not live(r, now) then -- its reservation ran out (its message was slow): renewed, never a second
      r.deadline = num(now + tonumber(ARGV[4]))
      redis.call('SET', KEYS[i], cjson.encode(r), 'PX', tonumber(ARGV[4]) + tonumber(ARGV[5]))
    end
    return admitted(i, r)
  end
end
if redis.call('ZSCORE', adopted, token) then
  return {ADMITTED, -1}
end
if redis.call('HGET', parked, id) then
  local found = redis.call('LPOS', queue, entry)
  return waiting(PARKED, found and found + 1 or 1)
end
local length = redis.call('LLEN', queue)
if free and length == 0 then
  return admitted(free, reserve(free, recs[free], token, id, now, tonumber(ARGV[4]), tonumber(ARGV[5])))
end
local w = tonumber(redis.call('HGET', weights, fair) or ARGV[7])
if not w or w <= 0 then
  w = 1
end
if ARGV[8] == '1' then
  local _, after = fair_place(queue, tags, state, since, fair, w)
  local found = after and redis.call('LPOS', queue, after)
  return waiting(WOULD_PARK, found and found + 1 or length + 1)
end
local position = fair_insert(queue, tags, state, since, entry, fair, w)
redis.call('HSET', parked, id, ARGV[2])
journaled(KEYS[n + 9], ARGV[9], now)
redis.call('ZADD', since, now, entry)
redis.call('PEXPIRE', since, FAIR_KEEP_MS)
for i = 1, n do
  local r = recs[i]
  if live(r, now) and not r.waiting then
    r.waiting = '1'
    redis.call('SET', KEYS[i], cjson.encode(r), 'KEEPTTL')
  end
end
return waiting(PARKED, position)
