-- Helpers of the hand-off: a free slot goes to the first parked run; runs that joined a holder
-- are handed to whoever ends it; a turned-away redelivery's own copy is dropped when its run ends.
-- Hand a free ``slot`` to the first parked run: the slot is reserved for it (its handoff token)
-- until it starts and adopts it; its entry stays in the queue until then, so a crash before its
-- message is sent loses nothing. ``recs``: the records of every slot; ``by``: who asks (it sends
-- the message); ``mine``: the asking run's own entry, if it is parked: when its turn has come,
-- nothing is handed on (false is returned) and it takes the slot itself; ``marker``: the enqueue
-- marker, to forget a dead holder's. Returns the message to send, or false.
local function hand_off(slot, n, recs, queue, parked, now, ttl, keep, by, mine, marker)
  for _, entry in ipairs(redis.call('LRANGE', queue, 0, 99)) do
    if entry == mine then
      return false
    end
    local sep = string.find(entry, '|', 1, true)
    local id, token = string.sub(entry, 1, sep - 1), string.sub(entry, sep + 1)
    local busy = false
    for i = 1, n do
      local r = recs[i]
      -- reserved on another slot (ran out too: it waits for that one, RESUME hands it again), or
      -- an own copy whose task id runs on another slot
      if i ~= slot and r and ((r.reserved and r.token == token)
          or (live(r, now) and (r.token == token or (is_own_copy(token) and r.task_id == id)))) then
        busy = true
      end
    end
    if not busy then
      local msg = redis.call('HGET', parked, id)
      if msg then
        local prev = recs[slot]
        local res = {v = PROTOCOL, token = token, task_id = id, reserved = '1', by = by, since = num(now),
          deadline = num(now + ttl), state = 'handing-off', waiting = '1'}
        if prev then
          res.fence, res.lost, res.joined, res.rt = prev.fence, prev.lost, prev.joined, prev.rt
          res.prev_task_id, res.prev_outcome = previous(prev, now)
          if expired(prev, now) then -- and who died, for the caller to end (a replay names it again)
            res.lost = add_lost(prev.lost, prev.fence)
            if prev.task_id ~= id then
              res.prev_worker, res.prev_task_name = prev.worker or '', prev.task_name or ''
            end
            forget_dead(marker, prev)
          end
        end
        redis.call('SET', KEYS[slot], cjson.encode(res), 'PX', ttl + keep)
        recs[slot] = res
        return msg
      end
      redis.call('LREM', queue, 1, entry) -- an entry without its message cannot run
    end
  end
  return false
end
-- a redelivery of run ``id`` parked a copy behind it (PARK, own copy): the run ended, so the copy
-- must not run, unless it was already handed a slot (its message is on its way)
local function drop_own_copy(id, queue, parked, recs, n, now)
  if not id or id == '' or not redis.call('HGET', parked, id) then
    return
  end
  local prefix = id .. '|' .. OWN_COPY
  for _, entry in ipairs(redis.call('LRANGE', queue, 0, -1)) do
    if string.sub(entry, 1, #prefix) == prefix then
      local token = string.sub(entry, #id + 2)
      for i = 1, n do
        if recs[i] and recs[i].token == token and live(recs[i], now) then return end
      end
      redis.call('LREM', queue, 1, entry)
      redis.call('HDEL', parked, id)
    end
  end
end
-- what an earlier call of ``by`` handed over (joined messages), for its replay
local function settled_for(settled, by)
  return decode(redis.call('HGET', settled, by)) or {}
end
-- the joined runs, handed to ``by``: kept under its name for its replay, each marked ANSWERED for
-- JOIN's, and stamped in TAKEN (JSON: token -> ms) for a sweeper to answer if the releaser's
-- worker is lost first (entries older than the hash's life are dropped)
local function take_joined(joined, settled, by)
  local messages = redis.call('LRANGE', joined, 0, -1)
  if #messages > 0 then
    local now, taken, kept = clock(), decode(redis.call('HGET', settled, TAKEN)) or {}, {}
    for token, at in pairs(taken) do
      if tonumber(at) > now - SETTLE_KEEP_MS then
        kept[token] = at
      else -- answered long ago: dropped with its messages' marks, so a busy key's hash stays small
        for _, m in ipairs(settled_for(settled, token)) do
          redis.call('HDEL', settled, ANSWERED .. redis.sha1hex(m))
        end
        redis.call('HDEL', settled, token)
      end
    end
    kept[by] = num(now)
    for _, m in ipairs(messages) do redis.call('HSET', settled, ANSWERED .. redis.sha1hex(m), by) end
    redis.call('HSET', settled, by, cjson.encode(messages), TAKEN, cjson.encode(kept))
    redis.call('PEXPIRE', settled, SETTLE_KEEP_MS)
    redis.call('DEL', joined)
  end
  return messages
end
-- ``out`` with ``messages`` appended (a reply's list of joined runs)
local function append(out, messages)
  for _, m in ipairs(messages) do
    table.insert(out, m)
  end
  return out
end
-- ACQUIRE: the parked run of ``handoff`` took its slot and did not lose that lease: another copy
-- of its message must not run it again (a run whose lease ran out unreleased may run again).
local function taken_before(adopted, handoff, recs, n, now)
  local fence = redis.call('ZSCORE', adopted, handoff)
  if not fence then
    return false
  end
  for i = 1, n do
    local r = recs[i]
    if r and (in_list(r.lost, fence) or (r.token and not r.reserved and r.fence == fence)) then
      return false -- lost, or its lease (not a reservation after it) is still in the record
    end
  end
  return true
end
