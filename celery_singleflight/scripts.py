"""The Lua scripts behind every lease mutation. Each is atomic and checks the owner token.

Times are milliseconds here and only here; the Python API speaks seconds.
Numbers are passed to Redis with ``string.format('%.0f')`` because Lua's default number
formatting would turn a 16-digit fence into ``1.7e+15``.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "FORCE_RELEASE",
    "NOTE_DUPLICATE",
    "PROGRESS",
    "RELEASE",
    "RENEW_MANY",
    "REVISE_OUTCOME",
]

ACQUIRE = """
-- KEYS[1] - lease hash of the key
-- KEYS[2] - fence counter of the key
-- ARGV[1] - token unique to this execution
-- ARGV[2] - lease TTL, milliseconds
-- ARGV[3] - holder task id
-- ARGV[4] - holder host
-- ARGV[5] - holder pid
-- ARGV[6] - holder worker node name
-- ARGV[7] - fence counter TTL, milliseconds (set when the counter is seeded)
-- ARGV[8] - holder task name
-- return {1, fence, since_ms} if acquired, {0, holder task id, lease ms left} if held
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('HGET', KEYS[1], 'task_id') or '', redis.call('PTTL', KEYS[1])}
end
local now = redis.call('TIME')
-- a missing counter is seeded from the clock (microseconds), so fences keep growing after
-- Redis lost its data or the counter expired; INCR keeps the TTL set here
redis.call('SET', KEYS[2], now[1] .. string.format('%06d', tonumber(now[2])), 'NX', 'PX', ARGV[7])
local fence = redis.call('INCR', KEYS[2])
local since = string.format('%.0f', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'task_id', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5],
  'worker', ARGV[6], 'fence', string.format('%.0f', fence), 'since', since, 'task_name', ARGV[8])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, fence, since}
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
local function status_for_run(lease_fields, status, history)
  local fence = lease_fields[5]
  if redis.call('HGET', status, 'fence') ~= fence then
    redis.call('DEL', status, history)
    redis.call('HSET', status, 'task_id', lease_fields[1], 'worker', lease_fields[2],
      'host', lease_fields[3], 'pid', lease_fields[4], 'fence', fence, 'started', lease_fields[6],
      'task_name', lease_fields[7])
  end
  return fence
end
local function now_ms()
  local t = redis.call('TIME')
  return string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
local LEASE_FIELDS = {'task_id', 'worker', 'host', 'pid', 'fence', 'since', 'task_name'}
"""

RELEASE = _STATUS_FOR_RUN + """
-- KEYS[1] - lease hash of the key
-- KEYS[2] - status hash of the key
-- KEYS[3] - history stream of the key
-- ARGV[1] - token of the holder
-- ARGV[2] - outcome of the run (succeeded, failed, retried, revoked, ...)
-- ARGV[3] - status retention, milliseconds (0: record nothing)
-- ARGV[4] - history length cap
-- return 1 if released, 0 if the lease was not ours
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
local holder = redis.call('HMGET', KEYS[1], unpack(LEASE_FIELDS))
redis.call('DEL', KEYS[1])
local retention = tonumber(ARGV[3])
if retention > 0 then
  local fence = status_for_run(holder, KEYS[2], KEYS[3])
  local now = now_ms()
  redis.call('HSET', KEYS[2], 'state', ARGV[2], 'outcome', ARGV[2], 'ended', now, 'updated', now)
  redis.call('PEXPIRE', KEYS[2], retention)
  if redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'kind', 'end', 'fence', fence,
      'state', ARGV[2], 'ts', now)
    redis.call('PEXPIRE', KEYS[3], retention)
  end
end
return 1
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
