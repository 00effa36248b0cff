-- RESEND: a sweeper found a delayed run whose message has not started well after its due time
-- (protocol/delayed.py): hand out its copy again, under a new token.
-- KEYS[1] - the key's delayed runs (hash: task id -> entry)
-- ARGV[1] - the run's task id
-- ARGV[2] - the new token (this call's: a replay carries it and gets the same answer)
-- ARGV[3..] - the workers alive now
-- A copy is sent again only when no worker that received one of the run's messages is alive (the
-- message waits in a busy worker, not lost), or, if no worker noted receiving one,
-- DELAYED_UNSEEN_GRACE_MS after its due time (or after the last copy was sent).
-- return {GONE} (it started, or is unknown: forget it), {NOT_DUE, ms} (not due, or a live worker
--        holds a copy: look again at that time), {RESEND, message, headers (JSON object or '')}
--        (send it with the new token)
local id, token = ARGV[1], ARGV[2]
local e = entry_of(KEYS[1], id)
if not e or e.c or not e.m then
  return {GONE}
end
local headers = e.h and cjson.encode(e.h) or ''
if e.t == token then
  return {RESEND, e.m, headers}
end
-- counted from its due time, or from when a sweeper last sent a copy (that copy may be lost too)
local now, due = clock(), math.max(tonumber(e.due), tonumber(e.sent or 0))
if due + DELAYED_GRACE_MS > now then
  return {NOT_DUE, due + DELAYED_GRACE_MS}
end
local seen = false
for _, worker in pairs(type(e.w) == 'table' and e.w or {}) do
  seen = true
  for i = 3, #ARGV do
    if ARGV[i] == worker then
      return {NOT_DUE, now + DELAYED_RECHECK_MS} -- a live worker holds it: not lost
    end
  end
end
if not seen and due + DELAYED_UNSEEN_GRACE_MS > now then
  return {NOT_DUE, due + DELAYED_UNSEEN_GRACE_MS}
end
e.r, e.t, e.w, e.sent = '1', token, nil, string.format('%d', now)
e.ts = e.ts or {}
table.insert(e.ts, token)
redis.call('HSET', KEYS[1], id, cjson.encode(e))
keep_for(KEYS[1], DELAYED_KEEP_MS)
return {RESEND, e.m, headers}
