-- RESEND: a sweeper looks at a delayed run whose message has not started (or whose claimant has
-- not said it started) a while after its due time (protocol/delayed.py): hand out its copy
-- again, under a new token.
-- KEYS[1] - the key's delayed runs (hash: task id -> entry)
-- ARGV[1] - the run's task id
-- ARGV[2] - the new token (this call's: a replay carries it and gets the same answer)
-- ARGV[3..] - the workers alive now
-- Every waiting copy has an owner a sweeper can check. Not claimed: the worker that noted
-- receiving one of the run's messages (TOUCH); a copy is sent again only when none of them is
-- alive, or, if no worker noted one, DELAYED_UNSEEN_GRACE_MS after its due time (or after the
-- last copy was sent): a copy sent early is harmless, CLAIM lets one run. Claimed but not done
-- (CLAIM_DONE): the claimant's worker; once it is gone (or the claim is DELAYED_CLAIM_PATIENCE_MS
-- old: its process died alone, or hangs before its start), the claim is taken back: its token
-- turns stale (CLAIM_DONE answers it TAKEN_BACK, so it never starts), and the copy goes again,
-- carrying the token the claimant's lease has (if that lease was taken, the copy takes it over);
-- so does every copy sent again after it, until a copy claims the run.
-- return {GONE} (it started, or is unknown: forget it), {NOT_DUE, ms} (not due, or a live worker
--        holds a copy or its claim: look again at that time), {RESEND, message, headers (JSON
--        object or ''), the taken-back claimant's lease token or ''} (send it with the new token)
local id, token = ARGV[1], ARGV[2]
local e = entry_of(KEYS[1], id)
if not e or not e.m then
  return {GONE}
end
local headers = e.h and cjson.encode(e.h) or ''
if e.t == token then
  return {RESEND, e.m, headers, e.took or ''}
end
local function alive(worker)
  for i = 3, #ARGV do
    if ARGV[i] == worker then
      return true
    end
  end
  return false
end
local now = clock()
if e.c then
  local since = tonumber(e.ca or 0)
  local patience = since + DELAYED_CLAIM_PATIENCE_MS
  if since + WORKER_GONE_AFTER_MS > now or (alive(e.o) and patience > now) then
    return {NOT_DUE, math.min(math.max(now + DELAYED_RECHECK_MS, since + WORKER_GONE_AFTER_MS), patience)}
  end
  make_stale(e, e.c) -- taken back: the claimant's token is stale from now on
  e.took, e.c, e.o, e.lt, e.ca = e.lt or '', nil, nil, nil, nil
else
  -- counted from its due time, or from when a sweeper last sent a copy (that copy may be lost too)
  local due = math.max(tonumber(e.due), tonumber(e.sent or 0))
  if due + DELAYED_GRACE_MS > now then
    return {NOT_DUE, due + DELAYED_GRACE_MS}
  end
  local seen = false
  for _, worker in pairs(type(e.w) == 'table' and e.w or {}) do
    seen = true
    if alive(worker) then
      return {NOT_DUE, now + DELAYED_RECHECK_MS} -- a live worker holds it: not lost
    end
  end
  if not seen and due + DELAYED_UNSEEN_GRACE_MS > now then
    return {NOT_DUE, due + DELAYED_UNSEEN_GRACE_MS}
  end
end
e.r, e.t, e.w, e.sent = '1', token, nil, string.format('%d', now)
e.ts = e.ts or {}
table.insert(e.ts, token)
redis.call('HSET', KEYS[1], id, cjson.encode(e))
keep_for(KEYS[1], DELAYED_KEEP_MS)
return {RESEND, e.m, headers, e.took or ''}
