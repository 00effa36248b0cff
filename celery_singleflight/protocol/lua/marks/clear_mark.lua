-- CLEAR_MARK: forget the enqueue marker of a task id (protocol/marks.py).
-- KEYS[1] - enqueue-time dedup marker of the key
-- ARGV[1] - the task id whose marker it must be
-- return CLEARED, or NOT_MARKED if the marker is another task's (or gone)
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return CLEARED
end
return NOT_MARKED
