"""The Lua scripts behind every lease mutation. Each is atomic and checks the owner token.

Times are milliseconds here and only here; the Python API speaks seconds.
Numbers are passed to Redis with ``string.format('%.0f')`` because Lua's default number
formatting would turn a 16-digit fence into ``1.7e+15``.
"""

from __future__ import annotations

__all__ = ["ACQUIRE", "RELEASE", "RENEW_MANY"]

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
  'worker', ARGV[6], 'fence', string.format('%.0f', fence), 'since', since)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, fence, since}
"""

RENEW_MANY = """
-- KEYS[i] - lease hash i
-- ARGV[2i-1] - token of lease i
-- ARGV[2i] - new TTL of lease i, milliseconds
-- return a list with, per lease, 1 if renewed, 0 if it is no longer ours
local out = {}
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'token') == ARGV[2 * i - 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

RELEASE = """
-- KEYS[1] - lease hash of the key
-- ARGV[1] - token of the holder
-- return 1 if released, 0 if the lease was not ours
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
