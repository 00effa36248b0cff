"""The Lua scripts behind every lease mutation. Each is atomic and checks the owner token.

Times are milliseconds here and only here; the Python API speaks seconds.
Numbers are passed to Redis with ``string.format('%.0f')`` because Lua's default number
formatting would turn a 16-digit fence into ``1.7e+15``.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "CLEAR_MARK",
    "ENQUEUE_MARK",
    "FORCE_RELEASE",
    "JOIN",
    "NOTE_DUPLICATE",
    "PARK",
    "PROGRESS",
    "RELEASE",
    "RENEW_MANY",
    "RESUME",
    "REVISE_OUTCOME",
]

#: handoff token prefix of the copy a turned-away redelivery parks behind its own run
OWN_COPY = "own-"

# Shared by ACQUIRE, RELEASE and RESUME: hand the key to the first parked run. The lease is
# reserved for it (its handoff token) until it starts and adopts it, or the reservation expires;
# its entry stays in the queue until then, so a crash before the message is sent loses nothing.
_HAND_OFF = """
-- a copy that a turned-away redelivery parked behind its own run has a handoff token starting
-- with OWN_COPY (SingleFlightTask._sf_park_redelivery)
local OWN_COPY = '""" + OWN_COPY + """'
local function is_own_copy(token)
  return string.sub(token, 1, #OWN_COPY) == OWN_COPY
end
-- ``slots``: how many slot leases of the key are KEYS[1..slots] (0: not known here). An own copy
-- is handed a slot only when no other slot is held by its own task id, which needs every slot:
-- where they are not known, it waits for the sweeper (RESUME).
local function may_run_elsewhere(id, lease, slots)
  if slots == 0 then
    return true
  end
  for i = 1, slots do
    if KEYS[i] ~= lease and redis.call('HGET', KEYS[i], 'task_id') == id then
      return true
    end
  end
  return false
end
local function hand_off(lease, queue, parked, ttl_ms, now_ms, slots)
  -- the first parked run not already holding a reservation on another slot of the key
  for _, entry in ipairs(redis.call('LRANGE', queue, 0, 99)) do
    local sep = string.find(entry, '|', 1, true)
    local id, token = string.sub(entry, 1, sep - 1), string.sub(entry, sep + 1)
    local reserved_on = redis.call('HGET', parked, 'r:' .. id)
    if not (reserved_on and redis.call('HGET', reserved_on, 'token') == token)
        and not (is_own_copy(token) and may_run_elsewhere(id, lease, slots)) then
      local msg = redis.call('HGET', parked, id)
      if msg then
        redis.call('DEL', lease)
        redis.call('HSET', lease, 'token', token, 'task_id', id, 'reserved', '1',
          'since', now_ms, 'host', '', 'pid', '0', 'worker', '', 'fence', '0', 'task_name', '')
        redis.call('PEXPIRE', lease, ttl_ms)
        redis.call('HSET', parked, 'r:' .. id, lease)
        return msg
      end
      redis.call('LREM', queue, 1, entry) -- an entry without its message cannot run
    end
  end
  return false
end
local function clock_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), t
end
"""

ACQUIRE = _HAND_OFF + """
-- KEYS[1..n] - the key's lease hashes, one per slot (n = max_concurrency, usually 1)
-- KEYS[n+1] - fence counter of the key (shared by its slots)
-- KEYS[n+2] - queue of parked runs (list of 'task id|handoff token')
-- KEYS[n+3] - parked messages (hash: task id -> message)
-- ARGV[1] - token unique to this execution
-- ARGV[2] - lease TTL, milliseconds
-- ARGV[3] - holder task id
-- ARGV[4] - holder host
-- ARGV[5] - holder pid
-- ARGV[6] - holder worker node name
-- ARGV[7] - fence counter TTL, milliseconds (refreshed on every acquire)
-- ARGV[8] - holder task name
-- ARGV[9] - handoff token this run was sent with ('' if it was never parked)
-- ARGV[10] - this run's queue entry 'task id|handoff token' ('' if never parked)
-- ARGV[11] - n, the number of slots
-- return {1, fence, since_ms, slot} if acquired (slot counts from 0),
--        {0, holder task id, lease ms left} if every slot is held (the holder whose lease ends first),
--        {2, holder task id, lease ms left, message} if a slot was free but handed to the first parked run
local n = tonumber(ARGV[11])
local fence_key, queue, parked = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
local now_ms, now = clock_ms()
local slot = nil
if ARGV[9] ~= '' then
  for i = 1, n do
    if redis.call('HGET', KEYS[i], 'token') == ARGV[9] then
      slot = i
      redis.call('DEL', KEYS[i]) -- adopting the reservation made for this run
      break
    end
  end
end
if not slot then
  -- the first free slot, else the holder whose lease ends first; every slot is looked at, since
  -- a task id already running on one of them (a redelivery) must not take another
  local holder, left = '', -1
  for i = 1, n do
    local id = redis.call('HGET', KEYS[i], 'task_id')
    if not id then
      slot = slot or i
    else
      local pttl = redis.call('PTTL', KEYS[i])
      if n > 1 and id == ARGV[3] and id ~= '' then
        return {0, id, pttl}
      end
      if left < 0 or pttl < left then
        holder, left = id, pttl
      end
    end
  end
  if not slot then
    return {0, holder, left}
  end
  if ARGV[10] == '' or redis.call('LINDEX', queue, 0) ~= ARGV[10] then
    local msg = hand_off(KEYS[slot], queue, parked, ARGV[2], string.format('%.0f', now_ms), n)
    if msg then
      return {2, redis.call('HGET', KEYS[slot], 'task_id'), redis.call('PTTL', KEYS[slot]), msg}
    end
  end
end
if ARGV[10] ~= '' then
  local id = string.sub(ARGV[10], 1, string.find(ARGV[10], '|', 1, true) - 1)
  redis.call('LREM', queue, 1, ARGV[10])
  redis.call('HDEL', parked, id, 'r:' .. id)
end
-- a missing counter (INCR gives 1) is seeded from the clock (microseconds), so fences keep
-- growing after Redis lost its data or the counter expired unused; its TTL is refreshed on
-- every acquire
local fence = redis.call('INCR', fence_key)
if fence == 1 then
  redis.call('SET', fence_key, now[1] .. string.format('%06d', tonumber(now[2])))
  fence = redis.call('INCR', fence_key)
end
redis.call('PEXPIRE', fence_key, ARGV[7])
local since = string.format('%.0f', now_ms)
redis.call('HSET', KEYS[slot], 'token', ARGV[1], 'task_id', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5],
  'worker', ARGV[6], 'fence', string.format('%.0f', fence), 'since', since, 'task_name', ARGV[8])
redis.call('PEXPIRE', KEYS[slot], ARGV[2])
return {1, fence, since, slot - 1}
"""

# Shared by PARK and RESUME: the first free slot of a key (KEYS[1..n] are its slot leases).
_FREE_SLOT = """
local function free_slot(n)
  for i = 1, n do
    if redis.call('EXISTS', KEYS[i]) == 0 then
      return i
    end
  end
  return nil
end
local function soonest_ttl(n)
  local left = -1
  for i = 1, n do
    local pttl = redis.call('PTTL', KEYS[i])
    if left < 0 or pttl < left then
      left = pttl
    end
  end
  return math.max(left, 0)
end
"""

PARK = _HAND_OFF + _FREE_SLOT + """
-- KEYS[1..n] - the key's slot leases
-- KEYS[n+1] - queue of parked runs
-- KEYS[n+2] - parked messages
-- ARGV[1] - the entry 'task id|handoff token'
-- ARGV[2] - the message to send when it is its turn
-- ARGV[3] - the most runs that may wait (-1: no limit)
-- ARGV[4] - n, the number of slots
-- An own copy (its token starts with OWN_COPY: a turned-away redelivery of the holder's own run)
-- waits at the front, beyond any limit, and only runs if that run's lease ends without a release
-- (RELEASE drops it); an entry already parked under its task id is kept as it is.
-- return {-1} if a slot is free (acquire again), {-2, length} if the queue is full,
--        {position, ms until the first holder's lease runs out} once parked
local n = tonumber(ARGV[4])
local queue, parked = KEYS[n + 1], KEYS[n + 2]
local sep = string.find(ARGV[1], '|', 1, true)
local id, own = string.sub(ARGV[1], 1, sep - 1), is_own_copy(string.sub(ARGV[1], sep + 1))
if free_slot(n) then
  return {-1}
end
local length = redis.call('LLEN', queue)
if not own and tonumber(ARGV[3]) >= 0 and length >= tonumber(ARGV[3]) then
  return {-2, length}
end
if not redis.call('HGET', parked, id) then
  if own then
    redis.call('LPUSH', queue, ARGV[1])
  else
    redis.call('RPUSH', queue, ARGV[1])
  end
  length = length + 1
elseif own then
  return {1, soonest_ttl(n)}
end
redis.call('HSET', parked, id, ARGV[2])
return {own and 1 or length, soonest_ttl(n)}
"""

ENQUEUE_MARK = """
-- KEYS[1] - enqueue-time dedup marker of the key
-- ARGV[1] - the task id about to be sent
-- ARGV[2] - marker TTL, milliseconds (a safety net if the message is lost)
-- return the task id already queued or running for the key, or false if ARGV[1] may be sent
local existing = redis.call('GET', KEYS[1])
if existing then
  return existing
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""

CLEAR_MARK = """
-- KEYS[1] - enqueue-time dedup marker of the key
-- ARGV[1] - the task id whose marker it must be
-- return 1 if cleared
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

JOIN = """
-- KEYS[1] - lease hash of the key
-- KEYS[2] - runs joined to the holder's run
-- ARGV[1] - the joining run's message (it gets the holder's result)
-- return {-1} if the key is free (acquire again), else {number joined, holder task id}
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {-1}
end
redis.call('RPUSH', KEYS[2], ARGV[1])
return {redis.call('LLEN', KEYS[2]), redis.call('HGET', KEYS[1], 'task_id') or ''}
"""

RESUME = _HAND_OFF + _FREE_SLOT + """
-- KEYS[1..n] - the key's slot leases
-- KEYS[n+1] - queue of parked runs
-- KEYS[n+2] - parked messages
-- KEYS[n+3] - runs joined to the holder's run
-- ARGV[1] - lease TTL for a handoff reservation, milliseconds
-- ARGV[2] - n, the number of slots
-- return {0} if nothing waits, {1, ms until a lease runs out} if every slot is held (check again
--        then), {2, reservation ms, message or '', orphaned joined runs...} if a slot was free: it
--        is handed to the first parked run, and runs joined to a dead holder are handed back
local n = tonumber(ARGV[2])
local queue, parked, joined = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
if redis.call('LLEN', queue) == 0 and redis.call('LLEN', joined) == 0 then
  return {0}
end
local slot = free_slot(n)
if not slot then
  return {1, soonest_ttl(n)}
end
local now_ms = clock_ms()
local msg = hand_off(KEYS[slot], queue, parked, ARGV[1], string.format('%.0f', now_ms), n)
local out = {2, tonumber(ARGV[1]), msg or ''}
if slot == 1 then -- joined runs only exist with one slot: their holder is gone
  for _, entry in ipairs(redis.call('LRANGE', joined, 0, -1)) do
    table.insert(out, entry)
  end
  redis.call('DEL', joined)
end
if out[3] == '' and #out == 3 then
  return {1, tonumber(ARGV[1])}
end
return out
"""

RENEW_MANY = """
-- KEYS[3i-2] - lease hash i
-- KEYS[3i-1] - status hash i
-- KEYS[3i]   - history stream i
-- ARGV[2i-1] - token of lease i
-- ARGV[2i]   - new TTL of lease i, milliseconds
-- ARGV[#ARGV] - status retention after the lease, milliseconds
-- return a list with, per lease, 1 if renewed, 0 if it is no longer ours
local retention = tonumber(ARGV[#ARGV])
local out = {}
for i = 1, #KEYS / 3 do
  local lease = KEYS[3 * i - 2]
  if redis.call('HGET', lease, 'token') == ARGV[2 * i - 1] then
    local ttl = tonumber(ARGV[2 * i])
    redis.call('PEXPIRE', lease, ttl)
    -- status and history outlive the lease by the retention (no-ops when absent)
    redis.call('PEXPIRE', KEYS[3 * i - 1], ttl + retention)
    redis.call('PEXPIRE', KEYS[3 * i], ttl + retention)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# Shared by RELEASE, FORCE_RELEASE and PROGRESS: start a fresh status for this run when the
# stored one belongs to an earlier run (another fence), copying the holder from the lease.
_STATUS_FOR_RUN = """
-- ``extra``: more fields to set (in the same HSET); returns the fence and whether the status is
-- new (then it has no history yet)
local function status_for_run(lease_fields, status, history, extra)
  local fence = lease_fields[5]
  if redis.call('HGET', status, 'fence') ~= fence then
    redis.call('DEL', status, history)
    local fields = {'task_id', lease_fields[1], 'worker', lease_fields[2], 'host', lease_fields[3],
      'pid', lease_fields[4], 'fence', fence, 'started', lease_fields[6], 'task_name', lease_fields[7]}
    for _, value in ipairs(extra or {}) do
      table.insert(fields, value)
    end
    redis.call('HSET', status, unpack(fields))
    return fence, true
  end
  if extra then
    redis.call('HSET', status, unpack(extra))
  end
  return fence, false
end
local function now_ms()
  local t = redis.call('TIME')
  return string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
local LEASE_FIELDS = {'task_id', 'worker', 'host', 'pid', 'fence', 'since', 'task_name'}
"""

RELEASE = _STATUS_FOR_RUN + _HAND_OFF + """
-- KEYS[1] - lease hash of the key
-- KEYS[2] - status hash of the key
-- KEYS[3] - history stream of the key
-- KEYS[4] - queue of parked runs
-- KEYS[5] - parked messages
-- KEYS[6] - runs joined to this run (list of their messages)
-- KEYS[7] - enqueue-time dedup marker (the task id queued for this key)
-- ARGV[1] - token of the holder
-- ARGV[2] - outcome of the run (succeeded, failed, retried, revoked, ...)
-- ARGV[3] - status retention, milliseconds (0: record nothing)
-- ARGV[4] - history length cap
-- ARGV[5] - lease TTL for a handoff reservation, milliseconds
-- ARGV[6] - '1' to hand the joined runs to the caller (who gives them this run's result)
-- ARGV[7] - the run's fence (to record its end even when its lease is already gone)
-- ARGV[8] - '1' if the run's task dedups at enqueue (its marker is cleared)
-- ARGV[9] - the run's task id (to drop the copy a redelivery parked, when the lease is gone)
-- ARGV[10] - the number of slots of the key (only KEYS[1], this run's slot, is declared here)
-- return {0} if the lease was not ours, else {1, message of the parked run now handed the key
--        or '', joined run messages...} (the caller sends the message and answers the joined runs)
local function drop_own_copy(id)
  -- a redelivery of this run parked a copy behind it (PARK, own copy): the run ended, so the
  -- copy must not run, unless the sweeper already handed it the key (its message is on its way)
  if not id or id == '' or not redis.call('HGET', KEYS[5], id) then
    return
  end
  local reserved_on = redis.call('HGET', KEYS[5], 'r:' .. id)
  if reserved_on and redis.call('HGET', reserved_on, 'task_id') == id then
    return
  end
  local prefix = id .. '|'
  for _, entry in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
    if string.sub(entry, 1, #prefix) == prefix then
      redis.call('LREM', KEYS[4], 1, entry)
    end
  end
  redis.call('HDEL', KEYS[5], id, 'r:' .. id)
end
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  -- the lease expired or was taken: drop this run's redelivery copy, and still record how this
  -- run ended on its own status
  if redis.call('LLEN', KEYS[4]) > 0 then
    drop_own_copy(ARGV[9])
  end
  if redis.call('HGET', KEYS[2], 'fence') == ARGV[7] and not redis.call('HGET', KEYS[2], 'ended') then
    local now = now_ms()
    redis.call('HSET', KEYS[2], 'state', 'lost', 'outcome', 'lost', 'ended', now, 'updated', now)
    if redis.call('EXISTS', KEYS[3]) == 1 then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'kind', 'end', 'fence', ARGV[7],
        'state', 'lost', 'ts', now)
    end
  end
  return {0}
end
local holder = redis.call('HMGET', KEYS[1], unpack(LEASE_FIELDS))
redis.call('DEL', KEYS[1])
local waiting = redis.call('LLEN', KEYS[4]) > 0
if waiting then
  drop_own_copy(holder[1])
end
if ARGV[8] == '1' and holder[1] and redis.call('GET', KEYS[7]) == holder[1] then
  redis.call('DEL', KEYS[7]) -- this run ended: the next enqueue sends a new message
end
local retention = tonumber(ARGV[3])
local now = now_ms()
if retention > 0 then
  local fence, fresh = status_for_run(holder, KEYS[2], KEYS[3],
    {'state', ARGV[2], 'outcome', ARGV[2], 'ended', now, 'updated', now})
  redis.call('PEXPIRE', KEYS[2], retention)
  if not fresh and redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'kind', 'end', 'fence', fence,
      'state', ARGV[2], 'ts', now)
    redis.call('PEXPIRE', KEYS[3], retention)
  end
end
local out = {1, waiting and hand_off(KEYS[1], KEYS[4], KEYS[5], ARGV[5], now,
  ARGV[10] == '1' and 1 or 0) or ''}
if ARGV[6] == '1' then
  local joined = redis.call('LRANGE', KEYS[6], 0, -1)
  if #joined > 0 then
    for _, message in ipairs(joined) do
      table.insert(out, message)
    end
    redis.call('DEL', KEYS[6])
  end
end
return out
"""

FORCE_RELEASE = _STATUS_FOR_RUN + """
-- KEYS[1] - lease hash of the key
-- KEYS[2] - status hash of the key
-- KEYS[3] - history stream of the key
-- ARGV[1] - who asked (recorded in the status)
-- ARGV[2] - status retention, milliseconds
-- ARGV[3] - history length cap
-- ARGV[4] - the holder task id the operator saw ('' to release whoever holds it)
-- return the released holder's {task id, fence}, or false if the key was free (or held by another)
local holder = redis.call('HMGET', KEYS[1], unpack(LEASE_FIELDS))
if not holder[1] then
  return false
end
if ARGV[4] ~= '' and holder[1] ~= ARGV[4] then
  return false
end
redis.call('DEL', KEYS[1])
local fence = status_for_run(holder, KEYS[2], KEYS[3])
local now = now_ms()
redis.call('HSET', KEYS[2], 'state', 'force-released', 'outcome', 'force-released', 'ended', now,
  'updated', now, 'released_by', ARGV[1])
redis.call('PEXPIRE', KEYS[2], math.max(tonumber(ARGV[2]), 1000))
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'kind', 'end', 'fence', fence,
  'state', 'force-released', 'by', ARGV[1], 'ts', now)
redis.call('PEXPIRE', KEYS[3], math.max(tonumber(ARGV[2]), 1000))
return {holder[1], fence}
"""

PROGRESS = _STATUS_FOR_RUN + """
-- KEYS[1] - lease hash of the key
-- KEYS[2] - status hash of the key
-- KEYS[3] - history stream of the key
-- ARGV[1] - token of the holder
-- ARGV[2] - status TTL (lease time left + retention), milliseconds
-- ARGV[3] - history length cap
-- ARGV[4] - the update as JSON (stored in the history entry)
-- ARGV[5..] - status field/value pairs (state, current, total, message, fields, ...)
-- return the history entry id, or false if the lease is not ours
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return false
end
local holder = redis.call('HMGET', KEYS[1], unpack(LEASE_FIELDS))
local fence = status_for_run(holder, KEYS[2], KEYS[3])
local now = now_ms()
redis.call('HDEL', KEYS[2], 'current', 'total', 'message', 'fields')
redis.call('HSET', KEYS[2], 'updated', now, unpack(ARGV, 5))
local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'kind', 'progress', 'fence', fence,
  'ts', now, 'data', ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return id
"""

REVISE_OUTCOME = """
-- KEYS[1] - status hash of the key
-- KEYS[2] - history stream of the key
-- ARGV[1] - task id of the run
-- ARGV[2] - the outcome recorded by the run itself (e.g. terminated)
-- ARGV[3] - the outcome the worker's main process knows (e.g. revoked)
-- return 1 if revised, 0 if the status is not that run's or says something else
if redis.call('HGET', KEYS[1], 'task_id') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'outcome') ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'outcome', ARGV[3])
return 1
"""

NOTE_DUPLICATE = _STATUS_FOR_RUN + """
-- KEYS[1] - lease hash of the key
-- KEYS[2] - status hash of the key
-- KEYS[3] - history stream of the key
-- ARGV[1] - the duplicate's task id
-- ARGV[2] - what happened to it (skipped, raised, retry, ...)
-- ARGV[3] - history length cap
-- return 1 if noted on the current holder's run, 0 if the key is free
local holder = redis.call('HMGET', KEYS[1], unpack(LEASE_FIELDS))
if not holder[1] then
  return 0
end
local fence = status_for_run(holder, KEYS[2], KEYS[3])
redis.call('HINCRBY', KEYS[2], 'duplicates', 1)
if redis.call('PTTL', KEYS[2]) < 0 then
  redis.call('PEXPIRE', KEYS[2], math.max(redis.call('PTTL', KEYS[1]), 1000))
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'kind', 'duplicate', 'fence', fence,
    'state', ARGV[2], 'task_id', ARGV[1], 'ts', now_ms())
end
return 1
"""
