-- LIMITS: set or clear a key's limits at run time (protocol/controls.py): 'c=<concurrency>
-- p=<peak> i=<interval µs> t=<tolerance µs> r=<rate as written>', each part optional. ACQUIRE,
-- RESUME and RATE read it in their own round trip.
-- KEYS[1] - the key's limits
-- ARGV[1] - 'set' or 'clear'
-- ARGV[2..5] - for 'set': the concurrency, the interval (µs), the tolerance (µs), the rate's text;
--              '' keeps the part as it was
-- The peak is the largest concurrency set since the limits were, so that a call names every slot
-- a run may still hold after the concurrency was lowered. Safe to run twice: the same value.
-- return {LIMITS_SET, the value} or {LIMITS_CLEARED, the value before ('' if none)}
local old = redis.call('GET', KEYS[1]) or ''
if ARGV[1] == 'clear' then
  redis.call('DEL', KEYS[1])
  return {LIMITS_CLEARED, old}
end
local parts = {}
local function part(name, given)
  local value = given
  if value == '' then
    value = string.match(old, '%f[%w]' .. name .. '=(%S+)')
  end
  if value then
    table.insert(parts, name .. '=' .. value)
  end
  return value
end
local c = part('c', ARGV[2])
local peak = math.max(tonumber(c or 0), tonumber(string.match(old, 'p=(%d+)') or 0),
  tonumber(string.match(old, 'c=(%d+)') or 0))
if peak > 0 then
  table.insert(parts, 'p=' .. peak)
end
part('i', ARGV[3])
part('t', ARGV[4])
part('r', ARGV[5])
local value = table.concat(parts, ' ')
redis.call('SET', KEYS[1], value)
return {LIMITS_SET, value}
