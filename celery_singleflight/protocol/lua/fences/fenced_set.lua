-- FENCED_SET: store a value only if its writer's fence is not older than the stored one
-- (``fencing.fenced_set``; protocol/fences.py).
-- KEYS[1] - the fenced value (hash: 'value', 'fence')
-- ARGV[1] - the value to store
-- ARGV[2] - the writer's fence: a non-negative decimal integer without leading zeros
-- ARGV[3] - TTL of the value, milliseconds ('' for none: like SET, an earlier TTL is removed)
-- return {WRITTEN, fence} if written (the stored fence was older, equal or absent),
--        {STALE, stored fence} if the stored fence is newer (nothing is written)
local function older(a, b)
  -- compared as decimal strings: Lua numbers are doubles and lose digits past 2^53
  if #a ~= #b then
    return #a < #b
  end
  return a < b
end
local stored = redis.call('HGET', KEYS[1], 'fence')
if stored and older(ARGV[2], stored) then
  return {STALE, stored}
end
redis.call('HSET', KEYS[1], 'value', ARGV[1], 'fence', ARGV[2])
if ARGV[3] == '' then
  redis.call('PERSIST', KEYS[1])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return {WRITTEN, ARGV[2]}
