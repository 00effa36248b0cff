-- NEWEST_START: a run of ``coalesce`` or ``supersede`` starts under its lease (protocol/newest.py).
-- KEYS[1] - the newest book of the key
-- KEYS[2] - the run record of its slot
-- ARGV[1] - its task id
-- ARGV[2] - its send stamp ('' if sent without one)
-- A run sent before another that is already pending or started must not run after it (a re-sent
-- message, a late countdown): it is stale. Running this twice answers the same.
-- return {STALE, the newer run's task id, messages of the runs it replaced (JSON) or ''};
--        {STARTED, messages of the runs it replaced (JSON) or '', its record or ''}
local book, id, stamp = KEYS[1], ARGV[1], ARGV[2]
local owed = redis.call('HGET', book, 'o:' .. id) or ''
local newer = newer_run(book, stamp, id)
if newer then
  redis.call('HDEL', book, 's:' .. id) -- it is no longer pending either way
  return {STALE, newer, owed}
end
redis.call('HDEL', book, 's:' .. id)
note_latest(book, stamp, id)
return {STARTED, owed, redis.call('GET', KEYS[2]) or ''}
