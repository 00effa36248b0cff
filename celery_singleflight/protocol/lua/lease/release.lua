-- RELEASE's general path: a record the plain path does not read (progress, joined or waiting
-- runs, a marker to clear), a replay, or a lease that ran out.
-- ``reservation_ttl`` stays a string: only a hand-off does sums with it (Lua converts it there)
local fence, reservation_ttl, answer, id, pause_ms, entry, own = string.match(ARGV[1], RELEASE_REST)
local clear, paused = flags == '1' or flags == '3', KEYS[n + 7]
answer = answer == '1'
local r = decode(raw)
if not (r and r.token == token) then
  if r and (r.rt == token or (r.reserved and r.by == token)) then
    -- this call ran before: answer as it did
    local msg = ''
    if r.reserved and r.by == token then
      msg = redis.call('HGET', parked, r.task_id) or ''
    end
    return append({RELEASED, msg}, settled_for(settled, token))
  end
  local handed = redis.call('HGET', settled, token)
  if handed then
    return append({RELEASED, ''}, cjson.decode(handed))
  end
  if r and fence ~= '' and not in_list(r.lost, fence) and tonumber(r.fence or 0) > tonumber(fence) then
    return {EARLIER} -- released by this run earlier (a newer run has the record now), or lost with the data
  end
  -- the lease ran out and another run took it (or Redis lost it): the run ended all the same, so
  -- its enqueue marker goes and its redelivery copy is dropped
  if clear and id ~= '' and redis.call('GET', marker) == id then
    redis.call('DEL', marker)
  end
  local now = clock()
  if redis.call('LLEN', queue) > 0 then
    drop_own_copy(id, queue, parked, records(n), n, now)
  end
  if not r and fence ~= '' then
    -- nothing is left of the key (Redis lost it): still record how this run ended
    redis.call('SET', KEYS[slot], cjson.encode({v = PROTOCOL, task_id = id, fence = fence, state = 'lost',
      outcome = 'lost', ended = num(now), updated = num(now)}), 'PX', keep, 'NX')
  end
  return {NOT_OURS}
end
local now = clock()
outcome = superseded_outcome(r, outcome)
r.token, r.deadline, r.rt, r.v = nil, nil, token, PROTOCOL -- a record of protocol 1 becomes ours
local ended = num(now)
r.state, r.outcome, r.ended, r.updated = outcome, outcome, ended, ended
history_end(r, history, cap, keep, now)
local out = {RELEASED, ''}
if answer and r.joined then
  append(out, take_joined(joined, settled, token))
  r.joined = nil
end
if clear and redis.call('GET', marker) == r.task_id then
  redis.call('DEL', marker) -- this run ended: the next enqueue sends a new message
end
if flags == '2' or flags == '3' then
  pause_and_park(paused, queue, parked, tonumber(pause_ms), entry, ARGV[4], now) -- RetryAfter
  r.waiting = '1'
end
if r.waiting and not paused_left(redis.call('GET', paused), now) then
  local recs = records(n, slot, r)
  drop_own_copy(r.task_id, queue, parked, recs, n, now)
  local msg = below_limit(redis.call('GET', KEYS[n + 8]), tonumber(own), recs, n, now)
    and hand_off(slot, n, recs, queue, parked, now, reservation_ttl, keep, token)
  if msg then
    out[2] = msg
    return out
  end
  if redis.call('LLEN', queue) == 0 then
    r.waiting = nil
  end
end
redis.call('SET', KEYS[slot], cjson.encode(r), 'PX', keep)
if #out == 2 then
  return RELEASED -- nothing handed on, nobody joined: the cheapest reply to read
end
return out
