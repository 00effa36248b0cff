-- PAUSE: pause a key for a while or until resumed, or end its pause (protocol/controls.py).
-- KEYS[1] - the key's pause: '<until ms>' (0: until resumed). Once over (ended, or run out) it
--           stays PAUSE_TAIL_MS as '<when it ended>': meanwhile a newcomer's ACQUIRE hands the key
--           to the runs parked during the pause before it may take it
-- ARGV[1] - how long, ms; 0: until resumed; -1: end the pause now
-- Safe to run twice: a pause sets the same end again (counted from this run), an end ends it.
-- return {PAUSED_UNTIL, until ms (0: until resumed)} for a pause; {RESUMED} or {NOT_PAUSED}
--        for an end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = tonumber(ARGV[1])
if ms < 0 then
  local ends = tonumber(string.match(redis.call('GET', KEYS[1]) or '', '^%d+') or -1)
  if ends == 0 or ends > now then
    redis.call('SET', KEYS[1], string.format('%d', now), 'PX', PAUSE_TAIL_MS)
    return {RESUMED}
  end
  return {NOT_PAUSED}
end
if ms == 0 then
  redis.call('SET', KEYS[1], '0')
  return {PAUSED_UNTIL, 0}
end
redis.call('SET', KEYS[1], string.format('%d', now + ms), 'PX', ms + PAUSE_TAIL_MS)
return {PAUSED_UNTIL, now + ms}
