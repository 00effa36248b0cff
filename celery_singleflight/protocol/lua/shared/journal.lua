-- The journal's marks (protocol/journaled.py).
--
-- a run begins to wait on this key: ``mark``, its worker's journal line's, is kept beside it, so
-- that the worker finds it while Redis has the data in which the run waited ('': not journaled)
local function journaled(marks, mark, now)
  if mark and mark ~= '' then
    redis.call('ZADD', marks, now, mark)
    redis.call('PEXPIRE', marks, JOURNAL_KEEP_MS)
  end
end
