-- ORDER_SWEEP: the sweeper's look at a key whose runs wait for their turn (protocol/order.py).
-- KEYS[1] - the order book of the key
-- KEYS[2] - the sequence numbers waiting
-- ARGV[1] - order_timeout, milliseconds, unless the book has the key's own ('to', set by the gate)
-- ARGV[2] - a call id unique to this look (a second run of it answers as the first did)
-- Runs wait for number ``next``. If its message is in the book (it was handed on, but has not
-- started after a whole timeout: its sender may have died before sending it), it is returned to
-- be sent again (a second copy is turned away by ORDER_GATE). If it is not, and the timeout has
-- passed since the wait began, ``next`` up to the smallest waiting number are skipped: that
-- run starts (its message is returned).
-- return {NOTHING_WAITS}; {NOT_YET, ms until the next look} if the timeout has not passed;
--        {SEND, message to send, first skipped number or '', last skipped number or ''}
local book, queue = KEYS[1], KEYS[2]
local timeout = tonumber(redis.call('HGET', book, 'to') or ARGV[1])
if redis.call('HGET', book, 'sw') == ARGV[2] then
  return cjson.decode(redis.call('HGET', book, 'swa'))
end
local function answer(out)
  redis.call('HSET', book, 'sw', ARGV[2], 'swa', cjson.encode(out))
  return out
end
local first = first_waiting(queue)
local nxt = tonumber(redis.call('HGET', book, 'next') or '1')
local waiting = redis.call('HGET', book, 'w:' .. nxt)
if not first and not waiting then
  redis.call('HDEL', book, 'at')
  return {NOTHING_WAITS}
end
local now = clock()
local at = tonumber(redis.call('HGET', book, 'at') or '0')
if at == 0 then
  at = now -- the wait is counted from the first look that finds it
  redis.call('HSET', book, 'at', at)
end
if now < at + timeout then
  return {NOT_YET, at + timeout - now}
end
redis.call('HSET', book, 'at', now)
keep_book(book, queue, ORDER_KEEP_MS)
if waiting then
  return answer({SEND, waiting, '', ''})
end
local target = tonumber(first)
local items = {}
for item in string.gmatch(redis.call('HGET', book, 'skipped') or '', '[^,]+') do
  table.insert(items, item)
end
for s = math.max(nxt, target - SKIPPED_KEPT), target - 1 do
  table.insert(items, tostring(s))
end
while #items > SKIPPED_KEPT do
  table.remove(items, 1)
end
redis.call('HSET', book, 'skipped', table.concat(items, ','), 'next', target)
redis.call('HDEL', book, 'a') -- a late advance of a skipped run hands nothing on
return answer({SEND, redis.call('HGET', book, 'w:' .. target) or '', tostring(nxt), tostring(target - 1)})
