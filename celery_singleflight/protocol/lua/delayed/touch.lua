-- TOUCH: a worker received a delayed run's message (protocol/delayed.py): note which worker holds
-- that copy, so that a sweeper sends the copy in Redis only if that worker is gone.
-- KEYS[1] - the key's delayed runs (hash: task id -> entry)
-- ARGV[1] - the run's task id
-- ARGV[2] - the token the received message carries
-- ARGV[3] - the receiving worker's name
-- Running it twice writes the same.
-- return {NOTED}, or {IGNORED} if the run started already or the token is not one of its copies
local e = entry_of(KEYS[1], ARGV[1])
if not e or e.c or not has_token(e, ARGV[2]) then
  return {IGNORED}
end
if type(e.w) ~= 'table' then
  e.w = {}
end
e.w[ARGV[2]] = ARGV[3]
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(e))
return {NOTED}
