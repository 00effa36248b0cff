-- Helpers of the run-time controls of a key (protocol/controls.py): a pause, and limits that
-- override the task's max_concurrency and key_rate_limit.
--
-- ms left of the pause whose value (``<until ms>``, 0: until resumed) is ``raw``: UNTIL_RESUMED
-- (-1) while it lasts until resumed; nil when not paused (no pause, or one that ended and keeps parked runs
-- ahead of newcomers for PAUSE_TAIL_MS)
local function paused_left(raw, now)
  if not raw then
    return nil
  end
  local ends = tonumber(string.match(raw, '^%d+'))
  if ends == 0 then
    return UNTIL_RESUMED
  end
  if ends > now then
    return ends - now
  end
  return nil
end
-- when the sweeper should look at a paused key again (a pause until resumed: now and then)
local function pause_look(left)
  if left < 0 then
    return PAUSE_LOOK_MS
  end
  return left
end
-- the concurrency override of the limits ``raw`` (``c=<n> p=<peak> ...``; nil: none), and how
-- many slots a call must name: every slot that may hold a run (the task's ``n``, the override,
-- the largest override since it was set)
local function slot_limits(raw, n)
  if not raw then
    return nil, n
  end
  local limit = tonumber(string.match(raw, 'c=(%d+)'))
  return limit, math.max(n, limit or 0, tonumber(string.match(raw, 'p=(%d+)')) or 0)
end
-- a free slot may be taken or handed on: fewer runs (or reservations) hold the key than its
-- limit, the concurrency of its limits ``raw`` or else ``own`` (the task's max_concurrency)
local function below_limit(raw, own, recs, n, now)
  local limit = slot_limits(raw, n) or own
  if limit >= n then
    return true
  end
  local count = 0
  for i = 1, n do
    if live(recs[i], now) then
      count = count + 1
    end
  end
  return count < limit
end
-- RELEASE of a run that raised RetryAfter: pause the key for ``ms`` (a longer pause stays) and
-- park the run's own message at the front of the key's queue (its entry 'task id|handoff token')
local function pause_and_park(paused, queue, parked, ms, entry, message, now)
  local left = paused_left(redis.call('GET', paused), now)
  if not left or (left >= 0 and left < ms) then
    redis.call('SET', paused, num(now + ms), 'PX', ms + PAUSE_TAIL_MS)
  end
  local id = string.sub(entry, 1, string.find(entry, '|', 1, true) - 1)
  if not redis.call('LPOS', queue, entry) then
    redis.call('LPUSH', queue, entry)
  end
  redis.call('HSET', parked, id, message)
end
