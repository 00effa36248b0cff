-- ORDER_ADVANCE: the admitted run holds the lease or waits in the queue: the next number's
-- turn comes (protocol/order.py).
-- KEYS[1] - the order book of the key
-- KEYS[2] - the sequence numbers waiting
-- ARGV[1] - the admitted run's sequence number
-- ARGV[2] - its delivery: 'task id|delivery tag'
-- return the next run's message if it waits (the caller sends it; it stays in the book until
-- that run is admitted, so the sweeper can send it again), else ''; a second run of the same
-- call answers the same
local book, queue = KEYS[1], KEYS[2]
local seq = tonumber(ARGV[1])
if redis.call('HGET', book, 'a') ~= ARGV[1] .. '|' .. ARGV[2] then
  return '' -- skipped meanwhile (it took longer than order_timeout)
end
local nxt = tonumber(redis.call('HGET', book, 'next') or '1')
if nxt == seq then
  redis.call('HSET', book, 'next', seq + 1)
elseif nxt ~= seq + 1 then
  return ''
end
local successor = redis.call('HGET', book, 'w:' .. (seq + 1))
if successor or first_waiting(queue) then
  local now = clock()
  redis.call('HSET', book, 'at', now) -- whoever waits waits for seq + 1 from now on
else
  redis.call('HDEL', book, 'at')
end
keep_book(book, queue, ORDER_KEEP_MS)
return successor or ''
