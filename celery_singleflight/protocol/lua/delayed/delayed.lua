-- Helpers of delayed runs: each entry of a key's ``delayed`` hash is JSON: ``t`` the token of the
-- copy last handed out, ``ts`` every token of this delay's copies (its countdown message, copies a
-- sweeper sent), ``old`` tokens of the run's earlier delays (stale), ``due`` (ms, server clock),
-- ``m`` its message (until it is claimed), ``h`` headers a copy must carry besides its token,
-- ``w`` which worker noted receiving which copy, ``r`` once a sweeper sent a copy, ``c`` the token
-- that claimed it. A claimed entry that more than one message may still come for is kept until
-- its time in the ``ends`` sorted set is over.
local function entry_of(hash, id)
  return decode(redis.call('HGET', hash, id))
end
-- the hash lives at least ``ms`` longer (never shorter: other entries may need more)
local function keep_for(hash, ms)
  if redis.call('PTTL', hash) < ms then
    redis.call('PEXPIRE', hash, ms)
  end
end
local function listed(tokens, token)
  for _, t in ipairs(tokens or {}) do
    if t == token then
      return true
    end
  end
  return false
end
-- a token of this delay's copies
local function has_token(e, token)
  return e.t == token or listed(e.ts, token)
end
-- a token of the run's earlier delays, or of a copy found stale or taken back
local function is_old(e, token)
  return listed(e.old, token)
end
-- ``token`` is stale from now on: out of this delay's tokens, into the old ones (the last few)
local function make_stale(e, token)
  local ts = {}
  for _, t in ipairs(e.ts or {}) do
    if t ~= token then
      table.insert(ts, t)
    end
  end
  e.ts, e.old = ts, e.old or {}
  if not is_old(e, token) then
    table.insert(e.old, token)
  end
  while #e.old > DELAYED_OLD_KEPT do
    table.remove(e.old, 1)
  end
end
-- drop a few claimed entries whose time is over
local function prune(hash, ends, now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', ends, '-inf', now, 'LIMIT', 0, 10)) do
    local e = entry_of(hash, id)
    if e and e.c then
      redis.call('HDEL', hash, id)
    end
    redis.call('ZREM', ends, id)
  end
end
-- a run delayed until ``due`` (ms) whose countdown message carries ``token``: its entry, which
-- remembers the tokens of its earlier delays (the last DELAYED_OLD_KEPT) as stale
local function delayed_entry(hash, ends, id, token, due, message, headers)
  local before, old = entry_of(hash, id), {}
  if before then
    for _, list in ipairs({before.old or {}, before.ts or {before.t}}) do
      for _, t in ipairs(list) do
        table.insert(old, t)
      end
    end
    while #old > DELAYED_OLD_KEPT do
      table.remove(old, 1)
    end
  end
  local e = {t = token, ts = {token}, due = string.format('%d', due), m = message, h = headers}
  if #old > 0 then
    e.old = old
  end
  redis.call('HSET', hash, id, cjson.encode(e))
  redis.call('ZREM', ends, id)
end
