-- ORDER_TAKE: the sequence number of a send (protocol/order.py).
-- KEYS[1] - the order book of the key (hash)
-- ARGV[1] - the task id about to be sent
-- return the task's sequence number: one more than the last one sent; a second run of the same
-- call (the last one taken) answers the same number
if redis.call('HGET', KEYS[1], 'last') == ARGV[1] then
  return tonumber(redis.call('HGET', KEYS[1], 'sent'))
end
local seq = tonumber(redis.call('HGET', KEYS[1], 'sent') or '0') + 1
redis.call('HSET', KEYS[1], 'sent', seq, 'last', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ORDER_KEEP_MS)
return seq
