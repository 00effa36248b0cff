-- DEBOUNCE_CALL: record a call of a debounce burst at send (protocol/timing.py).
-- KEYS[1] - the key's open burst (hash: leader, first, last, due, count, payload, c:<task id>)
-- KEYS[2] - the key's last closed burst (the same hash, renamed, with ran: who ran it)
-- ARGV[1] - the call's task id
-- ARGV[2] - debounce, ms
-- ARGV[3] - max wait, ms (0: none)
-- ARGV[4] - 'last' (the call's arguments become the payload) or 'first'
-- ARGV[5] - the call's arguments (JSON)
-- ARGV[6] - the token of its countdown message ('' to keep no copy of it)
-- ARGV[9] - when the call was sent, ms ('' if unknown: it counts as the newest); with 'last', a call
--           sent before the one whose arguments the burst has (recorded late) does not replace them
-- KEYS[3], KEYS[4], ARGV[7], ARGV[8] - with a token: the key's delayed runs and their ends
--           (protocol/delayed.py), the call's message, and the name of the header that names its
--           leader; the copy is due when its countdown message is (another call: the grace after)
-- return {leader's task id, ms until the burst's run is due, calls folded}. A call already
-- recorded (a replay) gets the same leader; one recorded in a burst closed since, wait 0.
local now = clock_ms()
local id = ARGV[1]
local b = redis.call('HMGET', KEYS[1], 'leader', 'first', 'due', 'count', 'c:' .. id, 'sent')
if b[1] and b[5] then
  return {b[1], math.max(0, tonumber(b[3]) - now), tonumber(b[4])}
end
local c = redis.call('HMGET', KEYS[2], 'leader', 'count', 'c:' .. id)
if c[1] and c[3] then
  return {c[1], 0, tonumber(c[2])}
end
local debounce, max_wait = tonumber(ARGV[2]), tonumber(ARGV[3])
local leader, first, count = b[1], tonumber(b[2]), tonumber(b[4] or '0') + 1
if not leader then
  leader, first = id, now
  redis.call('HSET', KEYS[1], 'leader', id, 'first', ms_text(now))
end
if not b[1] or ARGV[4] == 'last' then
  take_payload(KEYS[1], ARGV[5], ARGV[9], b[6])
end
local due = now + debounce
if max_wait > 0 and due > first + max_wait then
  due = math.max(now, first + max_wait)
end
redis.call('HSET', KEYS[1], 'last', ms_text(now), 'due', ms_text(due), 'count', count, 'c:' .. id, 1)
redis.call('PEXPIRE', KEYS[1], math.floor(due - now + DEBOUNCE_CLOSED_KEEP_MS))
if ARGV[6] ~= '' then
  local at = leader == id and due or due + DEBOUNCE_GRACE_MS
  prune(KEYS[3], KEYS[4], now)
  delayed_entry(KEYS[3], KEYS[4], id, ARGV[6], at, ARGV[7], {[ARGV[8]] = leader})
  keep_for(KEYS[3], at - now + DELAYED_KEEP_MS)
end
return {leader, due - now, count}
