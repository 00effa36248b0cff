-- Helpers of fair share (protocol/fair.py): a gate's queue kept in fair order, and the slot
-- reserved for a run that may start at once.
--
-- A score as text that reads back the same.
local function fmt(x)
  return string.format('%.17g', x)
end
-- Reserve free ``slot`` (its record ``prev``) for the run ``id`` whose token is ``token``, as a
-- hand-off does: the run adopts it when it takes the gate (ACQUIRE with that token). A holder
-- that died there with runs waiting at the gate is named in the reservation (the caller ends its
-- run; a replay names it again).
local function reserve(slot, prev, token, id, now, ttl, keep)
  local res = {v = PROTOCOL, token = token, task_id = id, reserved = '1', by = FAIR_BY, since = num(now),
    deadline = num(now + ttl), state = 'handing-off'}
  if prev then
    res.fence, res.lost, res.rt = prev.fence, prev.lost, prev.rt
    res.prev_task_id, res.prev_outcome = previous(prev, now)
    if expired(prev, now) then
      res.lost = add_lost(prev.lost, prev.fence)
      if prev.task_id ~= id and prev.waiting then
        res.prev_worker, res.prev_task_name = prev.worker or '', prev.task_name or ''
      end
    end
  end
  redis.call('SET', KEYS[slot], cjson.encode(res), 'PX', ttl + keep)
  return res
end
-- FAIR_ENTER's answer for a run whose slot ``res`` is reserved for it: the slot (0-based) and the
-- holder that died there, if any
local function admitted(slot, res)
  return {ADMITTED, slot - 1, dead_named(res)}
end
-- The virtual time: the tag of the queue's first entry, the next to be served (0 when empty).
-- Tags below it belong to entries that left the queue: they are dropped here.
local function virtual_time(queue, tags, state, since)
  local vt = 0
  for _, e in ipairs(redis.call('LRANGE', queue, 0, 9)) do
    local t = redis.call('ZSCORE', tags, e)
    if t then
      vt = tonumber(t)
      break
    end
  end
  for _, gone in ipairs(redis.call('ZRANGEBYSCORE', tags, '-inf', '(' .. fmt(vt), 'LIMIT', 0, 100)) do
    redis.call('ZREM', tags, gone)
    redis.call('ZREM', since, gone)
    redis.call('HDEL', state, FAIR_OF .. gone)
  end
  return vt
end
-- The place of ``entry`` of fair key ``fair`` (weight ``w``) in the queue: start-time fair
-- queueing. A run's tag is its start: the end of its fair key's run before it (each run ends
-- ``1 / w`` after its start), or the virtual time if that is later (a newcomer starts beside the
-- queue's head); the queue, kept sorted by tag, serves the fair keys in turn. Returns the tag,
-- the first entry with a larger one (false: the entry goes last), and the fair key's next start.
local function fair_place(queue, tags, state, since, fair, w)
  local vt = virtual_time(queue, tags, state, since)
  local last = tonumber(redis.call('HGET', state, FAIR_LAST .. fair) or '0')
  local tag = math.max(vt, last)
  local after = redis.call('ZRANGEBYSCORE', tags, '(' .. fmt(tag), '+inf', 'LIMIT', 0, 1)[1]
  return tag, after or false, tag + 1 / w
end
-- Put ``entry`` at its fair place; its 1-based position.
local function fair_insert(queue, tags, state, since, entry, fair, w)
  if redis.call('LLEN', queue) == 0 then
    redis.call('DEL', tags, state, since)
  end
  local tag, after, next_start = fair_place(queue, tags, state, since, fair, w)
  local placed = false
  for _ = 1, 5 do
    if not after then
      break
    end
    if redis.call('LINSERT', queue, 'BEFORE', after, entry) > 0 then
      placed = true
      break
    end
    redis.call('ZREM', tags, after) -- it left the queue: try the next
    after = redis.call('ZRANGEBYSCORE', tags, '(' .. fmt(tag), '+inf', 'LIMIT', 0, 1)[1]
  end
  if not placed then
    redis.call('RPUSH', queue, entry)
  end
  redis.call('ZADD', tags, tag, entry)
  redis.call('HSET', state, FAIR_LAST .. fair, fmt(next_start), FAIR_OF .. entry, fair)
  redis.call('PEXPIRE', tags, FAIR_KEEP_MS)
  redis.call('PEXPIRE', state, FAIR_KEEP_MS)
  redis.call('PEXPIRE', since, FAIR_KEEP_MS)
  return redis.call('LPOS', queue, entry) + 1
end
-- The recent run times (ms) of the gate's runs: their mean, 0 if none is known.
local function mean_time(times)
  local sum, count = 0, 0
  for _, t in ipairs(redis.call('LRANGE', times, 0, -1)) do
    sum, count = sum + tonumber(t), count + 1
  end
  return count > 0 and math.floor(sum / count) or 0
end
-- Take ``entry`` out of the gate's queue (it leaves without running): its message, tags and
-- parked time go. Its fair key, or false if it is not waiting (it left, or a slot is reserved
-- for it).
local function unpark(n, queue, parked, tags, state, since, entry, now)
  local sep = string.find(entry, '|', 1, true)
  local id, token = string.sub(entry, 1, sep - 1), string.sub(entry, sep + 1)
  for i = 1, n do
    local r = decode(redis.call('GET', KEYS[i]))
    if r and r.token == token and live(r, now) then
      return false
    end
  end
  local fair = redis.call('HGET', state, FAIR_OF .. entry) or ''
  redis.call('ZREM', tags, entry)
  redis.call('ZREM', since, entry)
  redis.call('HDEL', state, FAIR_OF .. entry)
  if redis.call('LREM', queue, 1, entry) == 0 then
    return false
  end
  redis.call('HDEL', parked, id)
  return fair
end
