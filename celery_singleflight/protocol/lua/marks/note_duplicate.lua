-- NOTE_DUPLICATE: count a duplicate on the holder's status and tell its watchers
-- (protocol/marks.py).
-- KEYS[1] - run record of the key
-- KEYS[2] - history stream of the key
-- ARGV[1] - the duplicate's task id
-- ARGV[2] - what happened to it (skipped, raised, retry, ...)
-- ARGV[3] - history length cap
-- return NOTED if noted on the current holder's run (once per duplicate and outcome), KEY_FREE
-- if the key is free
local r = decode(redis.call('GET', KEYS[1]))
local now = clock()
if not live(r, now) then
  return KEY_FREE
end
local seen = ARGV[1] .. '|' .. ARGV[2]
if r.dup_last == seen then
  return NOTED
end
r.duplicates, r.dup_last = num(tonumber(r.duplicates or '0') + 1), seen
redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
if r.history then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'kind', 'duplicate', 'fence', r.fence or '',
    'state', ARGV[2], 'task_id', ARGV[1], 'ts', num(now))
end
return NOTED
