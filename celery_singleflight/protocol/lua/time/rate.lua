-- RATE: a per-key rate limit shared by every worker, GCRA (``key_rate_limit``; protocol/timing.py).
-- KEYS[1] - the key's theoretical arrival time, emission interval and tolerance (string:
-- '<tat> <interval> <tolerance>', microseconds; the last two for readers such as the CLI)
-- KEYS[2] - cells granted (sorted set: call id -> planned start, microseconds)
-- KEYS[3] - the key's limits set at run time (controls: 'i=<interval µs> t=<tolerance µs>'
--           overrides ARGV[1] and ARGV[2])
-- ARGV[1] - emission interval, microseconds (one cell)
-- ARGV[2] - tolerance, microseconds ((burst - 1) cells)
-- ARGV[3] - call id: task id and retries
-- A granted cell is remembered RATE_GRANT_KEEP_US after its planned start.
-- return {planned start, now, 1 if granted by this call, 0 if granted before}: microseconds of
-- the server clock. A call already granted (a replay, a re-sent run) gets its cell again, unless
-- it comes more than RATE_LATE_US (or one interval, if longer) after it: a run that late (its
-- worker died, Redis was away) takes a new cell once, so late runs do not all start at once (a
-- second time, it keeps that cell: a worker that cannot keep up is not made later still). A cell
-- taken again is scored a quarter of a microsecond late: that is how the script knows it.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval, tolerance, keep = tonumber(ARGV[1]), tonumber(ARGV[2]), RATE_GRANT_KEEP_US
local limits = redis.call('GET', KEYS[3])
if limits and string.match(limits, 'i=(%d+)') then
  interval, tolerance = tonumber(string.match(limits, 'i=(%d+)')), tonumber(string.match(limits, 't=(%d+)') or 0)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%.0f', now - keep))
local planned = redis.call('ZSCORE', KEYS[2], ARGV[3])
local replanned = planned and true or false
if planned and (tonumber(planned) >= now - math.max(RATE_LATE_US, interval) or tonumber(planned) % 1 ~= 0) then
  return {math.floor(tonumber(planned)), now, 0}
end
local tat = tonumber(string.match(redis.call('GET', KEYS[1]) or '0', '^%d+'))
if tat < now then
  tat = now
end
planned = math.max(now, tat - tolerance)
tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.0f %.0f %.0f', tat, interval, tolerance), 'PX',
  math.floor((tat - now) / 1000) + 1)
redis.call('ZADD', KEYS[2], replanned and string.format('%.0f.25', planned) or string.format('%.0f', planned),
  ARGV[3])
redis.call('PEXPIRE', KEYS[2], math.floor((planned - now + keep) / 1000) + 1)
return {planned, now, 1}
