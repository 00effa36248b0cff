-- ORDER_GATE: may this run go on, or does it wait for its turn? (protocol/order.py)
-- KEYS[1] - the order book of the key (hash: 'sent', 'next', 'at', 'a', 'to', 'skipped', 'w:<seq>')
-- KEYS[2] - the sequence numbers waiting (sorted set)
-- KEYS[3] - the journal marks of runs waiting on the key (protocol/epoch.py)
-- ARGV[1] - the run's sequence number
-- ARGV[2] - this delivery: 'task id|delivery tag'
-- ARGV[3] - its message (kept while it waits for its turn)
-- ARGV[4] - order_timeout, milliseconds (kept as the key's own, 'to')
-- ARGV[5] - the run's journal mark ('' if it is not journaled)
-- A run goes on when every smaller number has gone on or was skipped ('next' is its number);
-- it is then *admitted* ('a'), and the next number's turn comes only when it has taken the
-- lease or entered the queue (ORDER_ADVANCE). A waiting run's message is kept in the book. A
-- second run of the admitting call answers the same; another delivery of an admitted run is
-- turned away.
-- return {GO} if this run may go on now;
--        {WAIT, ms until its predecessor counts as missing} if it waits for its turn (parked);
--        {LATE} if its turn was skipped (it came too late): it goes on by arrival;
--        {ANOTHER_DELIVERY} if another delivery of this run was admitted: this one does not run
local book, queue = KEYS[1], KEYS[2]
local seq, me, timeout = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[4])
local admitted = redis.call('HGET', book, 'a') or ''
if admitted == ARGV[1] .. '|' .. me then
  return {GO}
end
local nxt = tonumber(redis.call('HGET', book, 'next') or '1')
if seq < nxt then
  if in_list(redis.call('HGET', book, 'skipped') or '', ARGV[1]) then
    return {LATE}
  end
  return {ANOTHER_DELIVERY}
end
local now = clock()
redis.call('HSET', book, 'to', timeout)
if seq == nxt then
  if string.sub(admitted, 1, #ARGV[1] + 1) == ARGV[1] .. '|' then
    return {ANOTHER_DELIVERY}
  end
  redis.call('HDEL', book, 'w:' .. seq)
  redis.call('ZREM', queue, seq)
  redis.call('HSET', book, 'a', ARGV[1] .. '|' .. me, 'at', now)
  keep_book(book, queue, ORDER_KEEP_MS)
  return {GO}
end
if not redis.call('HGET', book, 'w:' .. seq) then
  redis.call('HSET', book, 'w:' .. seq, ARGV[3])
  redis.call('ZADD', queue, seq, seq)
  journaled(KEYS[3], ARGV[5], now)
end
local at = tonumber(redis.call('HGET', book, 'at') or '0')
if at == 0 then
  at = now
  redis.call('HSET', book, 'at', at)
end
keep_book(book, queue, ORDER_KEEP_MS)
return {WAIT, math.max(at + timeout - now, 0)}
