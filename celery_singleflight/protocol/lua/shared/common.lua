-- Helpers of every feature: the clock, run records and their tests, the slots of a key.
-- A script carries only the helpers it calls (protocol/lua.py); capitals are declared constants.
local function clock()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + (us - us % 1000) / 1000, s * 1000000 + us
end
local function num(n)
  return string.format('%d', n)
end
local function decode(raw)
  if raw then
    return cjson.decode(raw)
  end
  return false
end
-- the run record of every slot (KEYS[1..n]); ``known``, if given, is slot ``slot``'s already
local function records(n, slot, known)
  local recs = {}
  for i = 1, n do
    if i == slot then
      recs[i] = known
    else
      recs[i] = decode(redis.call('GET', KEYS[i]))
    end
  end
  return recs
end
-- the version of a record this protocol cannot read, else nil (a record without ``v`` is
-- protocol 1, which this one reads as its own)
local function foreign(recs, n)
  for i = 1, n do
    local r = recs[i]
    if r and r.v and r.v ~= PROTOCOL then
      return r.v
    end
  end
  return nil
end
-- the record holds the key: a run's lease or a reservation whose time has not run out
local function live(r, now)
  return r and r.token and tonumber(r.deadline) > now
end
-- a run's lease that ran out without a release (its run died, or froze past its TTL)
local function expired(r, now)
  return r and r.token and not r.reserved and tonumber(r.deadline) <= now
end
-- the slots of a key: the first free one (nil if all are held), and the holder whose lease
-- ends first with its ms left (-1 if none is held) and its slot (nil if none)
local function scan(recs, n, now)
  local free, holder, left, held_at = nil, '', -1, nil
  for i = 1, n do
    local r = recs[i]
    if not live(r, now) then
      free = free or i
    else
      local ms_left = tonumber(r.deadline) - now
      if left < 0 or ms_left < left then
        holder, left, held_at = r.task_id or '', ms_left, i
      end
    end
  end
  return free, holder, left, held_at
end
-- every slot's record when all are held, and the ms until the first lease runs out (nil: a slot is free)
local function all_held(n, now)
  local recs = records(n)
  local free, _, left = scan(recs, n, now)
  if free then
    return nil
  end
  return recs, left
end
local function is_own_copy(token)
  return string.sub(token, 1, #OWN_COPY) == OWN_COPY
end
local function in_list(list, item)
  return list ~= nil and string.find(',' .. list .. ',', ',' .. item .. ',', 1, true) ~= nil
end
-- ``lost`` with ``fence`` added (the last few kept)
local function add_lost(list, fence)
  local items = {}
  for item in string.gmatch((list or '') .. ',' .. fence, '[^,]+') do
    table.insert(items, item)
  end
  while #items > LOST_KEPT do
    table.remove(items, 1)
  end
  return table.concat(items, ',')
end
-- who ran on a slot before the record that replaces ``r``, and how it ended (a reservation
-- passes on what it was told)
local function previous(r, now)
  if r.reserved then
    return r.prev_task_id, r.prev_outcome
  end
  if r.token then
    return r.task_id, live(r, now) and 'running' or 'expired'
  end
  return r.task_id, r.outcome
end
-- a run whose lease ran out unreleased is gone: its enqueue marker no longer stands for it
local function forget_dead(marker, r)
  if marker and r.task_id and redis.call('GET', marker) == r.task_id then
    redis.call('DEL', marker)
  end
end
-- the fence of a new run: larger than every fence the key's records know, and than the clock
local function next_fence(recs, n, now_us)
  local fence = now_us
  for i = 1, n do
    local r = recs[i]
    if r and r.fence and tonumber(r.fence) + 1 > fence then
      fence = tonumber(r.fence) + 1
    end
  end
  return fence
end
