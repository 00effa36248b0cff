-- COALESCE: make this run the key's one pending run (``coalesce``, and ``supersede`` with mode
-- 'supersede'; protocol/newest.py).
-- KEYS[1..n] - the key's run records
-- KEYS[n+1] - queue of parked runs
-- KEYS[n+2] - parked messages
-- KEYS[n+3] - the newest book (hash: 's:<id>' -> send stamp of the pending run, 'o:<id>' -> JSON
--             list of the messages of runs it replaced, until they are answered)
-- KEYS[n+4] - hand-off tokens of parked runs that took their slot (ADOPTED)
-- KEYS[n+5] - the journal marks of runs waiting on the key (protocol/epoch.py)
-- ARGV[1] - the entry 'task id|handoff token'
-- ARGV[2] - the message to send when it is its turn
-- ARGV[3] - 'last' (a newer duplicate replaces the pending run), 'first' (it is dropped), or
--           'supersede' (as 'last', and the runs holding the key are marked superseded by it)
-- ARGV[4] - n, the number of slots
-- ARGV[5] - the run's send stamp (a whole number; '' if sent without one: it counts as the newest)
-- ARGV[6] - supersede: the grace before a superseded run is revoked, milliseconds
-- ARGV[7] - supersede: the revoke's signal name
-- ARGV[8] - the run's journal mark ('' if it is not journaled)
-- The pending run is the queued entry not yet handed a slot (a reserved one is as good as
-- running; a redelivery's own copy is not a run of its own). A second run of the same call finds
-- this run parked and answers as the first did; every held record is flagged ``waiting``, so
-- its release hands the key on (the queue's hand-off, unchanged). A superseded record keeps
-- when it was first superseded (``sup_at``, and ``sup_due``: when it is revoked); ``sup_by``
-- names the newest run that superseded it, and the holder's process is told at once (a push).
-- return {FREE} if a slot is free (acquire again), unless a run sent after it is pending or started;
--        {PENDING, ms until the first holder's lease runs out, sup_due ms or '', messages...} once
--        this run is the pending one: the messages of the runs it replaced (the caller ends them,
--        then deletes 'o:<id>');
--        {GIVES_WAY, task id} if this run gives way to the pending run, or to a run sent after it
--        that is pending or started already (it does not run)
local n, mode = tonumber(ARGV[4]), ARGV[3]
local queue, parked, book, adopted = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4]
local sep = string.find(ARGV[1], '|', 1, true)
local id, stamp = string.sub(ARGV[1], 1, sep - 1), ARGV[5]
local now = clock()
-- a second run of this call: the run is pending, or was handed the key and took it since (its
-- token is adopted); it answers PENDING with the runs it replaced, never FREE, so that the caller
-- does not run it a second time
if redis.call('HGET', parked, id) or redis.call('ZSCORE', adopted, string.sub(ARGV[1], sep + 1)) then
  local recs = records(n)
  local _, _, left = scan(recs, n, now)
  return append({PENDING, math.max(left, 0), recs[1] and recs[1].sup_due or ''}, owed(book, id))
end
-- before FREE: a run sent after this one is pending or started already (this is a late copy, or
-- this call sent again after a newer run replaced its run): this run must not take the key
local newer = newer_run(book, stamp, id)
if newer then
  return {GIVES_WAY, newer}
end
local recs, left = all_held(n, now)
if not recs then
  return {FREE}
end
local pending, pending_id = nil, nil
for _, entry in ipairs(redis.call('LRANGE', queue, 0, -1)) do
  local s = string.find(entry, '|', 1, true)
  local token = string.sub(entry, s + 1)
  local reserved = is_own_copy(token)
  for i = 1, n do
    if recs[i].token == token then
      reserved = true
    end
  end
  if not reserved then
    pending, pending_id = entry, string.sub(entry, 1, s - 1)
  end
end
local replaced = {}
if pending then
  local theirs = redis.call('HGET', book, 's:' .. pending_id)
  local newer = stamp == '' or not theirs or tonumber(stamp) >= tonumber(theirs)
  if mode == 'first' or not newer then
    return {GIVES_WAY, pending_id}
  end
  replaced = owed(book, pending_id)
  local msg = redis.call('HGET', parked, pending_id)
  if msg then
    table.insert(replaced, msg)
  end
  redis.call('LREM', queue, 1, pending)
  redis.call('HDEL', parked, pending_id)
  redis.call('HDEL', book, 's:' .. pending_id, 'o:' .. pending_id)
  if #replaced > 0 then
    redis.call('HSET', book, 'o:' .. id, cjson.encode(replaced))
  end
end
redis.call('RPUSH', queue, ARGV[1])
redis.call('HSET', parked, id, ARGV[2])
journaled(KEYS[n + 5], ARGV[8], now)
if stamp ~= '' then
  redis.call('HSET', book, 's:' .. id, stamp)
end
note_latest(book, stamp, id)
redis.call('PEXPIRE', book, NEWEST_KEEP_MS)
for i = 1, n do
  local r = recs[i]
  local changed = not r.waiting
  r.waiting = '1'
  if mode == 'supersede' then
    if not r.sup_at then
      r.sup_at, r.sup_due = num(now), num(now + tonumber(ARGV[6]))
    end
    r.sup_by, r.sup_sig, changed = id, ARGV[7], true
  end
  if changed then
    redis.call('SET', KEYS[i], cjson.encode(r), 'KEEPTTL')
  end
  if mode == 'supersede' then
    tell_holder(KEYS[i], r, TOLD_SUPERSEDED .. '\31' .. id .. '\31' .. r.sup_at .. '\31' .. r.sup_due)
  end
end
return append({PENDING, left, recs[1].sup_due or ''}, replaced)
