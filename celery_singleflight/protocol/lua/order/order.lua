-- Helpers of strict send order (``ordered=True``).
local function keep_book(book, queue, ms)
  redis.call('PEXPIRE', book, ms)
  redis.call('PEXPIRE', queue, ms) -- nothing if no run waits
end
-- the smallest waiting sequence number, or nil (only the commands of the documented ACL rule)
local function first_waiting(queue)
  return redis.call('ZRANGEBYSCORE', queue, '-inf', '+inf', 'LIMIT', 0, 1)[1]
end
