"""The Lua scripts behind every lease mutation: each is atomic, checks the owner token, and is
safe to run twice.

Why "twice": redis-py sends a command again when its reply was lost (a timeout, a dropped
connection), so a script can run on the server twice while the caller sees one answer, the
second. Every script here therefore recognises its own earlier run (by the token, the task id or
a call id) and gives the answer the first run gave, changing nothing more.

**The run record.** Each slot of a key has one record, a JSON string (``<ns>:{<key>}:run``): the
lease (``token``, ``deadline``, holder, ``fence``) and the status of the run (state, progress,
outcome) in one value, so that taking and releasing a key are one ``SET`` each. The lease runs
out when ``deadline`` (server milliseconds) passes; the key itself lives ``keep`` longer, so the
outcome, the fence and the proof of a release survive for a replay, the status reader and the
next fence. Numbers are stored as strings: ``cjson`` would print a 16-digit fence as ``1.7e+15``.

**The plain path.** Most runs are plain: one slot, never parked, nobody joined, no progress.
ACQUIRE writes a run's record with its lease fields first in a fixed order, and marks a plain
run's record by opening it with ``{ `` (JSON allows the space; ``cjson`` never writes one, so a
script that changes the record drops the mark). RELEASE reads such a record as text and writes
the released one the same way, and the next ACQUIRE reads that as text too. Both answer these
calls before they make any helper; the records decode to what the general path would write.

**Fences** are ``max(last fence + 1, server clock in microseconds)``: they only grow, also after
Redis lost its data or came back from an older snapshot, unless the server's clock goes back.

**Replays.** A release leaves ``rt`` (the releasing token) in the record, a hand-off reservation
``by`` (who made it, and so must send its message); joined runs handed to a releaser are kept
under its token in ``settled`` for :data:`SETTLE_KEEP_MS`. A record whose lease ran out
unreleased is remembered in the next record's ``lost`` list (the last few fences), so a late or
replayed release can tell "released before" from "lost".

Times are milliseconds here and only here; the Python API speaks seconds.
"""

from __future__ import annotations

import re

__all__ = [
    "ACQUIRE",
    "ALL_SCRIPTS",
    "CLEAR_MARK",
    "COALESCE",
    "ORDER_ADVANCE",
    "ORDER_GATE",
    "ORDER_SWEEP",
    "ORDER_TAKE",
    "ENQUEUE_MARK",
    "FORCE_RELEASE",
    "JOIN",
    "NOTE_DUPLICATE",
    "OWN_COPY",
    "PARK",
    "PLAIN_RELEASED",
    "PLAIN_RUNNING",
    "PROGRESS",
    "RELEASE",
    "RENEW_MANY",
    "RESUME",
    "REVISE_OUTCOME",
    "SETTLE_KEEP_MS",
]

#: handoff token prefix of the copy a turned-away redelivery parks behind its own run
OWN_COPY = "own-"
#: how long joined runs handed to a releaser stay readable for a replay of that release
SETTLE_KEEP_MS = 120_000
#: how many fences of runs whose lease ran out a record remembers
_LOST_KEPT = 8
#: the Lua pattern RELEASE reads a plain run's record with, after its token: fence, since, and
#: where the rest starts (``rt`` if the previous run left one, ``lost`` if runs were lost, the
#: holder, the previous run)
PLAIN_RUNNING = '^(%d+)","since":"(%d+)","deadline":"%d+","state":"running",()'
#: the Lua pattern ACQUIRE reads a released plain record with: the releasing token, the fence, the
#: outcome and the task id (a JSON string literal without escapes, copied as it is); a record with
#: ``lost`` between them takes the general path (a lease ran out unreleased: rare)
PLAIN_RELEASED = '^{ "rt":"([^"]*)","fence":"(%d+)","outcome":"([^"]*)","task_id":("[^"\\\\]*")'

def _helpers(library: str) -> list[tuple[str, str]]:
    """A helper library split into its definitions, ``(name, text)`` in order: each ``local
    function name`` or ``local NAME =`` at the start of a line, with the comment lines above it."""
    found: list[tuple[str, str]] = []
    comments: list[str] = []
    for line in library.strip("\n").split("\n"):
        named = re.match(r"local (?:function )?(\w+)", line)
        if named:
            found.append((named.group(1), "".join(c + "\n" for c in comments) + line + "\n"))
            comments = []
        elif line.startswith("--"):  # a comment at the margin introduces the next definition
            comments.append(line)
        else:
            name, text = found[-1]
            found[-1] = (name, text + line + "\n")
    return found


def _fields(n: int) -> str:
    """The Lua pattern that reads the ``n`` fields of a call packed into one argument (separated
    by \\31, the unit separator; the last field takes the rest, so it may hold anything). One
    argument is cheaper to send than many, and one ``string.match`` with a pattern written
    out here is the cheapest way for a script to read it."""
    return "^" + "([^\\31]*)\\31" * (n - 1) + "(.*)$"


def _script(*parts: str, plain: str = "") -> str:
    """A script: its body (the last part) after the helpers of the libraries (the other parts)
    that it uses, directly or through another helper, in their order. Lua makes a closure of
    every ``local function`` each time a script runs, so a script carries only the helpers it
    calls, and ``plain`` (the script's plain path, which returns early on the commonest call)
    comes before them all: a call it answers makes none."""
    *libraries, body = parts
    helpers = [helper for library in libraries for helper in _helpers(library)]
    used: set[str] = set()
    seen = body
    code = re.sub(r"--[^\n]*", "", plain)  # the plain path without its comments
    for name, text in reversed(helpers):  # a helper only calls helpers defined before it
        if re.search(rf"\b{name}\b", seen):
            used.add(name)
            seen += text
        if re.search(rf"\b{name}\b", code):
            raise ValueError(f"the plain path runs before the helpers, so it cannot use {name}")
    return plain + "".join(text for name, text in helpers if name in used) + body


# Shared by every script: the clock, records and their tests.
_COMMON = """
local OWN_COPY = '""" + OWN_COPY + """'
local function clock()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + (us - us % 1000) / 1000, s * 1000000 + us
end
local function num(n)
  return string.format('%d', n)
end
local function decode(raw)
  if raw then
    return cjson.decode(raw)
  end
  return false
end
-- the record holds the key: a run's lease or a reservation whose time has not run out
local function live(r, now)
  return r and r.token and tonumber(r.deadline) > now
end
-- a run's lease that ran out without a release (its run died, or froze past its TTL)
local function expired(r, now)
  return r and r.token and not r.reserved and tonumber(r.deadline) <= now
end
local function is_own_copy(token)
  return string.sub(token, 1, #OWN_COPY) == OWN_COPY
end
local function in_list(list, item)
  return list ~= nil and string.find(',' .. list .. ',', ',' .. item .. ',', 1, true) ~= nil
end
-- ``lost`` with ``fence`` added (the last few kept)
local function add_lost(list, fence)
  local items = {}
  for item in string.gmatch((list or '') .. ',' .. fence, '[^,]+') do
    table.insert(items, item)
  end
  while #items > """ + str(_LOST_KEPT) + """ do
    table.remove(items, 1)
  end
  return table.concat(items, ',')
end
-- who ran on a slot before the record that replaces ``r``, and how it ended (a reservation
-- passes on what it was told)
local function previous(r, now)
  if r.reserved then
    return r.prev_task_id, r.prev_outcome
  end
  if r.token then
    return r.task_id, live(r, now) and 'running' or 'expired'
  end
  return r.task_id, r.outcome
end
-- a run whose lease ran out unreleased is gone: its enqueue marker no longer stands for it
local function forget_dead(marker, r)
  if marker and r.task_id and redis.call('GET', marker) == r.task_id then
    redis.call('DEL', marker)
  end
end
-- every slot's record (KEYS[1..n]) when all are held, and the ms until the first lease runs
-- out; nil when a slot is free
local function all_held(n, now)
  local recs, left = {}, -1
  for i = 1, n do
    recs[i] = decode(redis.call('GET', KEYS[i]))
    if not live(recs[i], now) then
      return nil
    end
    local ms_left = tonumber(recs[i].deadline) - now
    if left < 0 or ms_left < left then
      left = ms_left
    end
  end
  return recs, left
end
-- the fence of a new run: larger than every fence the key's records know, and than the clock
local function next_fence(recs, n, now_us)
  local fence = now_us
  for i = 1, n do
    local r = recs[i]
    if r and r.fence and tonumber(r.fence) + 1 > fence then
      fence = tonumber(r.fence) + 1
    end
  end
  return fence
end
"""

# Shared by ACQUIRE, RELEASE, RESUME and FORCE_RELEASE: hand a free slot to the first parked run.
# The slot is reserved for it (its handoff token) until it starts and adopts it; its entry stays
# in the queue until then, so a crash before its message is sent loses nothing.
_HAND_OFF = """
-- ``recs``: the records of every slot (KEYS[1..n]); ``by``: who asks (it sends the message);
-- ``mine``: the asking run's own entry, if it is parked: when its turn has come, nothing is
-- handed on (false is returned) and it takes the slot itself; ``marker``: the enqueue marker, to
-- forget a dead holder's
local function hand_off(slot, n, recs, queue, parked, now, ttl, keep, by, mine, marker)
  for _, entry in ipairs(redis.call('LRANGE', queue, 0, 99)) do
    if entry == mine then
      return false
    end
    local sep = string.find(entry, '|', 1, true)
    local id, token = string.sub(entry, 1, sep - 1), string.sub(entry, sep + 1)
    local busy = false
    for i = 1, n do
      local r = recs[i]
      if i ~= slot and live(r, now) then
        -- already reserved on another slot, or an own copy whose task id runs on another slot
        if r.token == token or (is_own_copy(token) and r.task_id == id) then
          busy = true
        end
      end
    end
    if not busy then
      local msg = redis.call('HGET', parked, id)
      if msg then
        local prev = recs[slot]
        local res = {token = token, task_id = id, reserved = '1', by = by, since = num(now),
          deadline = num(now + ttl), state = 'handing-off', waiting = '1'}
        if prev then
          res.fence, res.lost, res.joined, res.rt = prev.fence, prev.lost, prev.joined, prev.rt
          res.prev_task_id, res.prev_outcome = previous(prev, now)
          if expired(prev, now) then
            res.lost = add_lost(prev.lost, prev.fence)
            forget_dead(marker, prev)
          end
        end
        redis.call('SET', KEYS[slot], cjson.encode(res), 'PX', ttl + keep)
        recs[slot] = res
        return msg
      end
      redis.call('LREM', queue, 1, entry) -- an entry without its message cannot run
    end
  end
  return false
end
"""

# The call's fields and the plain path come first: a call the plain path answers makes no helper.
_ACQUIRE_PLAIN = """
-- KEYS[1..n] - the key's run records, one per slot (n = max_concurrency, usually 1; #KEYS - 3)
-- KEYS[n+1]  - queue of parked runs (list of 'task id|handoff token')
-- KEYS[n+2]  - parked messages (hash: task id -> message)
-- KEYS[n+3]  - enqueue-time dedup marker (a dead holder's is removed)
-- ARGV[1] - the call, its fields separated by \\31:
--           1 token unique to this execution
--           2 lease TTL, milliseconds
--           3 how long the record outlives its lease, milliseconds
--           4 the two added: the record's expiry (PX), sent ready (one conversion less here)
--           5 handoff token this run was sent with ('' if it was never parked)
--           6 the token of an earlier attempt of this run whose reply never came ('' if none)
--           7 holder task id
-- ARGV[2] - the holder's fields, JSON object members without braces
-- return 'fence:since ms:slot:superseded by' if acquired (one string: the cheapest reply to read;
--        slot counts from 0; the task id of a run that superseded this one on its way, else ''),
--        also when this is a second run of the same call;
--        {0, holder task id, lease ms left} if every slot is held (the holder whose lease ends first);
--        {2, holder task id, lease ms left, message} if a slot was free but handed to the first
--        parked run (the caller sends its message)
local token, ttl, keep, px, handoff, earlier, id = string.match(ARGV[1], '""" + _fields(7) + """')
-- ``keep`` stays a string: only a hand-off does sums with it (Lua converts it there)
local n = #KEYS - 3
local queue, parked, marker = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
local first = redis.call('GET', KEYS[1])
if n == 1 and handoff == '' and earlier == '' then
  -- The plain path: one slot, a run never parked, and a key with no record (nobody held it
  -- lately) or with the record a plain run's release left (it opens with '{ ', see RELEASE). What
  -- the general path below would do, reading that record as text and the clock's digits as they
  -- come.
  local rt, fence, outcome, prev_id = '', nil, nil, nil
  if first then
    -- what is read comes first in a released plain record (a pattern costs the server per byte)
    rt, fence, outcome, prev_id = string.match(first, '""" + PLAIN_RELEASED + """')
  end
  if rt then
    local t = redis.call('TIME')
    local us = string.sub('00000' .. t[2], -6)
    local since, new_fence = t[1] .. string.sub(us, 1, 3), t[1] .. us
    local extra = ''
    if fence then
      if fence + 1 > tonumber(new_fence) then
        new_fence = string.format('%d', fence + 1)
      end
      rt = '"rt":"' .. rt .. '",'
      extra = ',"prev_task_id":' .. prev_id .. ',"prev_outcome":"' .. outcome .. '"'
    end
    redis.call('SET', KEYS[1], '{ "token":"' .. token .. '","fence":"' .. new_fence .. '","since":"' ..
      since .. '","deadline":"' .. string.format('%d', since + ttl) .. '","state":"running",' .. rt ..
      ARGV[2] .. extra .. '}', 'PX', px)
    return new_fence .. ':' .. since .. ':0:'
  end
end
"""

_ACQUIRE_GENERAL = """
ttl = tonumber(ttl)
local recs = {decode(first)}
for i = 2, n do
  recs[i] = decode(redis.call('GET', KEYS[i]))
end
local now, now_us = clock()
local slot, waiting = nil, false
for i = 1, n do
  local r = recs[i]
  -- this call ran before and its reply was lost: answer as it did, with the lease counted from
  -- now (the caller starts its run only now; a reply held back long may find it run out)
  if r and r.token == token then
    if tonumber(r.deadline) < now + ttl then
      r.deadline = num(now + ttl)
      redis.call('SET', KEYS[i], cjson.encode(r), 'PX', px)
    end
    return r.fence .. ':' .. r.since .. ':' .. (i - 1) .. ':' .. (r.sup_by or '')
  end
  if r and r.reserved and r.by == token then
    local msg = redis.call('HGET', parked, r.task_id) or ''
    return {2, r.task_id, math.max(tonumber(r.deadline) - now, 0), msg}
  end
  if r and r.waiting then
    waiting = true
  end
end
for i = 1, n do
  local r = recs[i]
  if r and r.token and ((handoff ~= '' and r.token == handoff and r.reserved)
      or (earlier ~= '' and r.token == earlier)) then
    slot = i -- the reservation made for this run, or this run's own earlier attempt
    break
  end
end
local adopting = slot ~= nil
if not slot then
  -- the first free slot, else the holder whose lease ends first; every slot is looked at, since
  -- a task id already running on one of them (a redelivery) must not take another
  local holder, left = '', -1
  for i = 1, n do
    local r = recs[i]
    if not live(r, now) then
      slot = slot or i
    else
      local ms_left = tonumber(r.deadline) - now
      if n > 1 and r.task_id == id and id ~= '' then
        return {0, id, ms_left}
      end
      if left < 0 or ms_left < left then
        holder, left = r.task_id or '', ms_left
      end
    end
  end
  if not slot then
    return {0, holder, left}
  end
  if waiting then
    local mine = handoff ~= '' and id .. '|' .. handoff
    local msg = hand_off(slot, n, recs, queue, parked, now, ttl, keep, token, mine, marker)
    if msg then
      return {2, recs[slot].task_id, ttl, msg}
    end
    waiting = redis.call('LLEN', queue) > 0
  end
end
if handoff ~= '' then
  -- leaving the queue: this run's entry and message
  redis.call('LREM', queue, 1, id .. '|' .. handoff)
  redis.call('HDEL', parked, id)
  waiting = redis.call('LLEN', queue) > 0
end
local prev = recs[slot]
local fence = num(next_fence(recs, n, now_us))
local extra, lost = '', ''
if prev then
  local prev_id, prev_outcome = previous(prev, now)
  if prev_id then
    extra = ',"prev_task_id":' .. cjson.encode(prev_id) ..
      ',"prev_outcome":' .. cjson.encode(prev_outcome or '')
  end
  lost = prev.lost or ''
  if expired(prev, now) and not adopting then
    lost = add_lost(lost, prev.fence)
    forget_dead(marker, prev)
  end
  if prev.joined then
    extra = extra .. ',"joined":"1"'
  end
  if adopting and prev.sup_by then
    -- a newer run superseded this one while it was on its way: it starts superseded
    extra = extra .. ',"sup_by":' .. cjson.encode(prev.sup_by) .. ',"sup_at":"' .. prev.sup_at ..
      '","sup_due":"' .. prev.sup_due .. '","sup_sig":' .. cjson.encode(prev.sup_sig or 'SIGTERM')
  end
end
if waiting then
  extra = extra .. ',"waiting":"1"'
end
local since = num(now)
-- The lease fields first, in this order, then ``rt`` and ``lost`` if set, then the holder (its
-- task id first). A plain run's record (nobody joined or waiting, not superseded) opens with '{ '
-- instead of '{': cjson never writes a space, so only a record this line wrote (and RENEW_MANY
-- kept) has it, and RELEASE may read it as text.
local open = (prev and (prev.joined or (adopting and prev.sup_by)) or waiting) and '{' or '{ '
local rt = prev and prev.rt and prev.rt ~= '' and '"rt":"' .. prev.rt .. '",' or ''
if lost ~= '' then
  rt = rt .. '"lost":"' .. lost .. '",'
end
redis.call('SET', KEYS[slot], open .. '"token":"' .. token .. '","fence":"' .. fence .. '","since":"' ..
  since .. '","deadline":"' .. num(now + ttl) .. '","state":"running",' .. rt .. ARGV[2] .. extra .. '}',
  'PX', px)
return string.format('%s:%s:%d:%s', fence, since, slot - 1, adopting and prev and prev.sup_by or '')
"""

ACQUIRE = _script(_COMMON, _HAND_OFF, _ACQUIRE_GENERAL, plain=_ACQUIRE_PLAIN)

# Shared by RELEASE and FORCE_RELEASE.
_ENDING = """
-- a redelivery of run ``id`` parked a copy behind it (PARK, own copy): the run ended, so the copy
-- must not run, unless it was already handed a slot (its message is on its way)
local function drop_own_copy(id, queue, parked, recs, n, now)
  if not id or id == '' or not redis.call('HGET', parked, id) then
    return
  end
  local prefix = id .. '|' .. OWN_COPY
  for _, entry in ipairs(redis.call('LRANGE', queue, 0, -1)) do
    if string.sub(entry, 1, #prefix) == prefix then
      local token = string.sub(entry, #id + 2)
      for i = 1, n do
        if recs[i] and recs[i].token == token and live(recs[i], now) then
          return
        end
      end
      redis.call('LREM', queue, 1, entry)
      redis.call('HDEL', parked, id)
    end
  end
end
-- the run's end in its history stream (only runs that reported progress have one, unless
-- ``always``: an operator's release wakes the watchers of any run)
local function history_end(r, history, cap, keep, now, extra, always)
  if r.history or always then
    local fields = {'kind', 'end', 'fence', r.fence or '', 'state', r.outcome, 'ts', num(now)}
    for _, value in ipairs(extra or {}) do
      table.insert(fields, value)
    end
    redis.call('XADD', history, 'MAXLEN', '~', cap, '*', unpack(fields))
    redis.call('PEXPIRE', history, keep)
  end
end
-- the joined runs, handed to ``by`` (kept under its name for a replay)
local function take_joined(joined, settled, by)
  local messages = redis.call('LRANGE', joined, 0, -1)
  if #messages > 0 then
    redis.call('HSET', settled, by, cjson.encode(messages))
    redis.call('PEXPIRE', settled, """ + str(SETTLE_KEEP_MS) + """)
    redis.call('DEL', joined)
  end
  return messages
end
local function settled_for(settled, by)
  local raw = redis.call('HGET', settled, by)
  if raw then
    return cjson.decode(raw)
  end
  return {}
end
"""

_RELEASE_PLAIN = """
-- KEYS[1..n] - the key's run records (n = its number of slots, #KEYS - 6; this run's is KEYS[slot])
-- KEYS[n+1] - this run's history stream
-- KEYS[n+2] - queue of parked runs
-- KEYS[n+3] - parked messages
-- KEYS[n+4] - runs joined to this run (list of their messages)
-- KEYS[n+5] - enqueue-time dedup marker (the task id queued for this key)
-- KEYS[n+6] - what earlier releases handed over (hash: releasing token -> joined messages)
-- ARGV[1] - the call, its fields separated by \\31:
--           1 token of the run
--           2 outcome of the run (succeeded, failed, retried, revoked, ...)
--           3 the run's fence ('' for an attempt that may not have taken the key)
--           4 slot, this run's slot (1-based)
--           5 lease TTL for a handoff reservation, milliseconds
--           6 '1' to hand the joined runs to the caller (who gives them this run's result)
--           7 '1' if the run's task dedups at enqueue (its marker is cleared)
--           8 the run's task id (to drop the copy a redelivery parked, when the lease is gone)
-- ARGV[2] - how long the record outlives the run, milliseconds (the store's constant)
-- ARGV[3] - the history length cap (the store's constant)
-- return {0} if the lease was not this run's (it ran out and another run took the key), else
--        {1, message of the parked run now handed the key or '', joined run messages...}: the
--        caller sends the message and answers the joined runs; a bare 1 when there is neither.
--        A second run of the same call answers as the first (a bare 1 may then come as {1, ''}).
local token, outcome, fence, slot, reservation_ttl, answer, clear, id =
  string.match(ARGV[1], '""" + _fields(8) + """')
-- ``reservation_ttl`` stays a string: only a hand-off does sums with it (Lua converts it there)
local n = #KEYS - 6
slot, answer, clear = tonumber(slot), answer == '1', clear == '1'
local keep, cap = ARGV[2], ARGV[3]
local history, queue, parked, joined, marker, settled =
  KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4], KEYS[n + 5], KEYS[n + 6]
local raw = redis.call('GET', KEYS[slot])
-- The plain path: the record of a plain run, as ACQUIRE wrote it (it opens with '{ '), with
-- nothing for this release to do but record the outcome (no history, which PROGRESS would have
-- re-encoded; no marker to clear; an outcome JSON would not escape). The text after the lease
-- fields and the previous ``rt`` (``lost``, the holder, the previous run) is kept as it is: the
-- record is neither decoded nor encoded. The answer and the record are the ones the general path
-- below would give; the record opens with '{ ' too, so the next ACQUIRE reads it as text.
if raw and not clear and not string.find(outcome, '[%c"\\\\]') then
  local head = '{ "token":"' .. token .. '","fence":"'
  if string.find(raw, head, 1, true) == 1 then
    local fence_s, since_s, rest = string.match(raw, '""" + PLAIN_RUNNING + """', #head + 1)
    if fence_s then
      if string.sub(raw, rest, rest + 5) == '"rt":"' then -- the previous run's: this one's replaces it
        rest = string.find(raw, '"', rest + 6, true) + 2
      end
      local t = redis.call('TIME')
      local ended = t[1] .. string.sub(string.sub('00000' .. t[2], -6), 1, 3)
      -- what the next ACQUIRE reads first: the releasing token, the fence, the outcome, then
      -- the holder's task id (or ``lost``), which opens the text kept as it was
      redis.call('SET', KEYS[slot], '{ "rt":"' .. token .. '","fence":"' .. fence_s .. '","outcome":"' ..
        outcome .. '",' .. string.sub(raw, rest, -2) .. ',"since":"' .. since_s .. '","state":"' .. outcome ..
        '","ended":"' .. ended .. '","updated":"' .. ended .. '"}', 'PX', keep)
      return 1
    end
  end
end
"""

_RELEASE_GENERAL = """
local r = decode(raw)
if not (r and r.token == token) then
  if r and (r.rt == token or (r.reserved and r.by == token)) then
    -- this call ran before: answer as it did
    local msg = ''
    if r.reserved and r.by == token then
      msg = redis.call('HGET', parked, r.task_id) or ''
    end
    local out = {1, msg}
    for _, m in ipairs(settled_for(settled, token)) do
      table.insert(out, m)
    end
    return out
  end
  local handed = redis.call('HGET', settled, token)
  if handed then
    local out = {1, ''}
    for _, m in ipairs(cjson.decode(handed)) do
      table.insert(out, m)
    end
    return out
  end
  if r and fence ~= '' and not in_list(r.lost, fence) and tonumber(r.fence or 0) > tonumber(fence) then
    return {1, ''} -- released by this run earlier; a newer run has the record now
  end
  -- the lease ran out and another run took it (or Redis lost it): the run ended all the same, so
  -- its enqueue marker goes and its redelivery copy is dropped
  if clear and id ~= '' and redis.call('GET', marker) == id then
    redis.call('DEL', marker)
  end
  local now = clock()
  if redis.call('LLEN', queue) > 0 then
    local recs = {}
    for i = 1, n do
      recs[i] = decode(redis.call('GET', KEYS[i]))
    end
    drop_own_copy(id, queue, parked, recs, n, now)
  end
  if not r and fence ~= '' then
    -- nothing is left of the key (Redis lost it): still record how this run ended
    redis.call('SET', KEYS[slot], cjson.encode({task_id = id, fence = fence, state = 'lost',
      outcome = 'lost', ended = num(now), updated = num(now)}), 'PX', keep, 'NX')
  end
  return {0}
end
local now = clock()
if r.sup_by and outcome ~= 'succeeded' then
  outcome = 'superseded' -- stopped, revoked or failed after a newer run took over (``sup_by``)
end
r.token, r.deadline, r.rt = nil, nil, token
local ended = num(now)
r.state, r.outcome, r.ended, r.updated = outcome, outcome, ended, ended
history_end(r, history, cap, keep, now)
local out = {1, ''}
if answer and r.joined then
  for _, m in ipairs(take_joined(joined, settled, token)) do
    table.insert(out, m)
  end
  r.joined = nil
end
if clear and redis.call('GET', marker) == r.task_id then
  redis.call('DEL', marker) -- this run ended: the next enqueue sends a new message
end
if r.waiting then
  local recs = {}
  for i = 1, n do
    recs[i] = i == slot and r or decode(redis.call('GET', KEYS[i]))
  end
  drop_own_copy(r.task_id, queue, parked, recs, n, now)
  local msg = hand_off(slot, n, recs, queue, parked, now, reservation_ttl, keep, token)
  if msg then
    out[2] = msg
    return out
  end
  if redis.call('LLEN', queue) == 0 then
    r.waiting = nil
  end
end
redis.call('SET', KEYS[slot], cjson.encode(r), 'PX', keep)
if #out == 2 then
  return 1 -- nothing handed on, nobody joined: the cheapest reply to read
end
return out
"""

RELEASE = _script(_COMMON, _HAND_OFF, _ENDING, _RELEASE_GENERAL, plain=_RELEASE_PLAIN)

RENEW_MANY = _script(_COMMON, """
-- KEYS[2i-1] - run record of lease i
-- KEYS[2i]   - its history stream
-- ARGV[2i-1] - token of lease i
-- ARGV[2i]   - new TTL of lease i, milliseconds
-- ARGV[#ARGV] - how long a record outlives its lease, milliseconds
-- return a list with, per lease, 1 if renewed, 2 if renewed but superseded (``supersede``: the
-- holder must stop), 0 if it is no longer this run's
local keep = tonumber(ARGV[#ARGV])
local now = clock()
local out = {}
for i = 1, #KEYS / 2 do
  local raw = redis.call('GET', KEYS[2 * i - 1])
  -- the token is hex: a plain search finds exactly the token field (quotes inside values are escaped)
  if raw and string.find(raw, '"token":"' .. ARGV[2 * i - 1] .. '"', 1, true) then
    local ttl = tonumber(ARGV[2 * i])
    raw = string.gsub(raw, '"deadline":"%d+"', '"deadline":"' .. num(now + ttl) .. '"', 1)
    redis.call('SET', KEYS[2 * i - 1], raw, 'PX', ttl + keep)
    if string.find(raw, '"history":"1"', 1, true) then
      redis.call('PEXPIRE', KEYS[2 * i], ttl + keep)
    end
    out[i] = string.find(raw, '"sup_by":', 1, true) and 2 or 1
  else
    out[i] = 0
  end
end
return out
""")

PROGRESS = _script(_COMMON, """
-- KEYS[1] - run record
-- KEYS[2] - history stream
-- ARGV[1] - token of the run
-- ARGV[2] - history length cap
-- ARGV[3] - the update as JSON (stored in the history entry and in the record)
-- ARGV[4] - the update's state
-- ARGV[5] - the update's number in this run (1, 2, ...): a second run of the same call writes nothing
-- ARGV[6] - the run's arguments as canonical JSON ('' unless the task opts in)
-- ARGV[7] - how long the record outlives its lease, milliseconds
-- return the history entry id, or false if the lease is not this run's, or 'sup|<task id>' if
-- a newer run superseded this one (``supersede``; the update is written all the same)
local r = decode(redis.call('GET', KEYS[1]))
if not (r and r.token == ARGV[1]) then
  return false
end
if tonumber(r.pseq or '0') >= tonumber(ARGV[5]) then
  if r.sup_by then
    return 'sup|' .. r.sup_by
  end
  return r.entry or '0-0'
end
local now = clock()
if not r.history then
  redis.call('DEL', KEYS[2]) -- an earlier run's entries
  r.history = '1'
end
r.state, r.progress, r.updated, r.pseq = ARGV[4], ARGV[3], num(now), ARGV[5]
if ARGV[6] ~= '' then
  r.args = ARGV[6]
end
r.entry = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'kind', 'progress', 'fence', r.fence,
  'ts', num(now), 'data', ARGV[3])
redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
redis.call('PEXPIRE', KEYS[2], tonumber(r.deadline) - now + tonumber(ARGV[7]))
if r.sup_by then
  return 'sup|' .. r.sup_by
end
return r.entry
""")

PARK = _script(_COMMON, """
-- KEYS[1..n] - the key's run records
-- KEYS[n+1] - queue of parked runs
-- KEYS[n+2] - parked messages
-- ARGV[1] - the entry 'task id|handoff token'
-- ARGV[2] - the message to send when it is its turn
-- ARGV[3] - the most runs that may wait (-1: no limit)
-- ARGV[4] - n, the number of slots
-- An own copy (its token starts with OWN_COPY: a turned-away redelivery of the holder's own run)
-- waits at the front, beyond any limit, and only runs if that run's lease ends without a release
-- (RELEASE drops it); an entry already parked under its task id is kept as it is, so a second run
-- of the same call parks nothing more.
-- Every held record is flagged ``waiting``, so its release hands the key on.
-- return {-1} if a slot is free (acquire again), {-2, length} if the queue is full,
--        {position, ms until the first holder's lease runs out} once parked
local n = tonumber(ARGV[4])
local queue, parked = KEYS[n + 1], KEYS[n + 2]
local sep = string.find(ARGV[1], '|', 1, true)
local id, own = string.sub(ARGV[1], 1, sep - 1), is_own_copy(string.sub(ARGV[1], sep + 1))
local now = clock()
local recs, left = all_held(n, now)
if not recs then
  return {-1}
end
local length = redis.call('LLEN', queue)
local position = own and 1 or length + 1
if not redis.call('HGET', parked, id) then
  if not own and tonumber(ARGV[3]) >= 0 and length >= tonumber(ARGV[3]) then
    return {-2, length}
  end
  if own then
    redis.call('LPUSH', queue, ARGV[1])
  else
    redis.call('RPUSH', queue, ARGV[1])
  end
  redis.call('HSET', parked, id, ARGV[2])
elseif not own then
  local found = redis.call('LPOS', queue, ARGV[1])
  position = found and found + 1 or length
end
for i = 1, n do
  if not recs[i].waiting then
    recs[i].waiting = '1'
    redis.call('SET', KEYS[i], cjson.encode(recs[i]), 'KEEPTTL')
  end
end
return {position, left}
""")

JOIN = _script(_COMMON, """
-- KEYS[1] - run record of the key
-- KEYS[2] - runs joined to the holder's run
-- ARGV[1] - the joining run's message (it gets the holder's result); added once, however often
--           this runs
-- return {-1} if the key is free (acquire again), else {number joined, holder task id}
local r = decode(redis.call('GET', KEYS[1]))
if not live(r, clock()) then
  return {-1}
end
if not redis.call('LPOS', KEYS[2], ARGV[1]) then
  redis.call('RPUSH', KEYS[2], ARGV[1])
end
if not r.joined then
  r.joined = '1'
  redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
end
return {redis.call('LLEN', KEYS[2]), r.task_id or ''}
""")

RESUME = _script(_COMMON, _HAND_OFF, _ENDING, """
-- KEYS[1..n] - the key's run records
-- KEYS[n+1] - queue of parked runs
-- KEYS[n+2] - parked messages
-- KEYS[n+3] - runs joined to the holder's run
-- KEYS[n+4] - what earlier calls handed over (hash: call id -> joined messages)
-- KEYS[n+5] - enqueue-time dedup marker (a dead holder's is removed)
-- ARGV[1] - lease TTL for a handoff reservation, milliseconds
-- ARGV[2] - n, the number of slots
-- ARGV[3] - a call id unique to this check (a second run of it answers the same)
-- ARGV[4] - how long a record outlives its lease, milliseconds
-- return {0} if nothing waits, {1, ms until a lease runs out} if every slot is held (check again
--        then), {2, reservation ms, message or '', orphaned joined runs...} if a slot was free: it
--        is handed to the first parked run, and runs joined to a gone holder are handed back
local n, ttl, by = tonumber(ARGV[2]), tonumber(ARGV[1]), ARGV[3]
local queue, parked, joined, settled, marker = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4], KEYS[n + 5]
local recs = {}
for i = 1, n do
  recs[i] = decode(redis.call('GET', KEYS[i]))
  if recs[i] and recs[i].reserved and recs[i].by == by then
    local out = {2, ttl, redis.call('HGET', parked, recs[i].task_id) or ''}
    for _, m in ipairs(settled_for(settled, by)) do
      table.insert(out, m)
    end
    return out
  end
end
if redis.call('HEXISTS', settled, by) == 1 then
  local out = {2, ttl, ''}
  for _, m in ipairs(settled_for(settled, by)) do
    table.insert(out, m)
  end
  return out
end
if redis.call('LLEN', queue) == 0 and redis.call('LLEN', joined) == 0 then
  return {0}
end
local now = clock()
local slot, left = nil, -1
for i = 1, n do
  if not live(recs[i], now) then
    slot = slot or i
  else
    local ms_left = tonumber(recs[i].deadline) - now
    if left < 0 or ms_left < left then
      left = ms_left
    end
  end
end
if not slot then
  return {1, math.max(left, 0)}
end
local out = {2, ttl, ''}
if expired(recs[slot], now) then
  forget_dead(marker, recs[slot])
end
if slot == 1 then -- joined runs only exist with one slot: their holder is gone
  for _, m in ipairs(take_joined(joined, settled, by)) do
    table.insert(out, m)
  end
  if recs[1] and recs[1].joined then
    recs[1].joined = nil
    redis.call('SET', KEYS[1], cjson.encode(recs[1]), 'KEEPTTL')
  end
end
out[3] = hand_off(slot, n, recs, queue, parked, now, ttl, tonumber(ARGV[4]), by, false, marker) or ''
if out[3] == '' and #out == 3 then
  return {1, ttl}
end
return out
""")

FORCE_RELEASE = _script(_COMMON, _HAND_OFF, _ENDING, """
-- KEYS[1..n] - the key's run records
-- KEYS[n+1] - the history stream of the released slot
-- KEYS[n+2] - queue of parked runs
-- KEYS[n+3] - parked messages
-- KEYS[n+4] - runs joined to the holder's run
-- KEYS[n+5] - what earlier calls handed over (hash: call id -> joined messages)
-- ARGV[1] - who asked (recorded in the status; also this call's id)
-- ARGV[2] - how long the record outlives the release, milliseconds
-- ARGV[3] - history length cap
-- ARGV[4] - the holder task id the operator saw ('' to release whoever holds it)
-- ARGV[5] - the slot to release (1-based)
-- ARGV[6] - n, the number of slots
-- ARGV[7] - lease TTL for a handoff reservation, milliseconds
-- ARGV[8] - '1' if the caller carries out the hand-on (sends the message, answers the joined
--           runs); '0' leaves both to the sweeper
-- return false if the slot was free (or held by another), else {released task id, its fence,
--        message of the parked run now handed the key or '', joined run messages...}
local n, slot, by = tonumber(ARGV[6]), tonumber(ARGV[5]), ARGV[1]
local history, queue, parked = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
local joined, settled = KEYS[n + 4], KEYS[n + 5]
local keep = math.max(tonumber(ARGV[2]), 1000)
local r = decode(redis.call('GET', KEYS[slot]))
if r and not r.token and r.outcome == 'force-released' and r.released_by == by
    and (ARGV[4] == '' or r.task_id == ARGV[4]) then
  local out = {r.task_id or '', r.fence or '0', ''} -- this call ran before: answer as it did
  for _, m in ipairs(settled_for(settled, by)) do
    table.insert(out, m)
  end
  return out
end
if not (r and r.token) or (ARGV[4] ~= '' and r.task_id ~= ARGV[4]) then
  return false
end
local now = clock()
if not r.reserved then
  r.lost = add_lost(r.lost, r.fence) -- its holder's late release must learn it lost the key
end
r.token, r.deadline, r.reserved, r.by = nil, nil, nil, nil
r.state, r.outcome, r.released_by = 'force-released', 'force-released', by
r.ended, r.updated = num(now), num(now)
history_end(r, history, ARGV[3], keep, now, {'by', by}, true)
local out = {r.task_id or '', r.fence or '0', ''}
local hand_on = ARGV[8] == '1'
if hand_on and slot == 1 and r.joined then
  for _, m in ipairs(take_joined(joined, settled, by)) do
    table.insert(out, m)
  end
  r.joined = nil
end
redis.call('SET', KEYS[slot], cjson.encode(r), 'PX', keep)
if hand_on and r.waiting then
  local recs = {}
  for i = 1, n do
    recs[i] = i == slot and r or decode(redis.call('GET', KEYS[i]))
  end
  out[3] = hand_off(slot, n, recs, queue, parked, now, tonumber(ARGV[7]), keep, by) or ''
end
return out
""")

REVISE_OUTCOME = _script(_COMMON, """
-- KEYS[1] - run record of the key
-- ARGV[1] - task id of the run
-- ARGV[2] - the outcome recorded by the run itself (e.g. terminated)
-- ARGV[3] - the outcome the worker's main process knows (e.g. revoked)
-- return 1 if revised (or already revised), 0 if the record is not that run's or says something else
-- (the run's outcome is also the ``prev_outcome`` of a run the key was handed to meanwhile)
local r = decode(redis.call('GET', KEYS[1]))
if r and r.prev_task_id == ARGV[1] and r.prev_outcome == ARGV[2] then
  r.prev_outcome = ARGV[3]
  redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
  return 1
end
if not r or r.task_id ~= ARGV[1] or r.token then
  return 0
end
if r.outcome == ARGV[3] then
  return 1
end
if r.outcome ~= ARGV[2] then
  return 0
end
r.state, r.outcome = ARGV[3], ARGV[3]
redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
return 1
""")

NOTE_DUPLICATE = _script(_COMMON, """
-- KEYS[1] - run record of the key
-- KEYS[2] - history stream of the key
-- ARGV[1] - the duplicate's task id
-- ARGV[2] - what happened to it (skipped, raised, retry, ...)
-- ARGV[3] - history length cap
-- return 1 if noted on the current holder's run (once per duplicate and outcome), 0 if the key is free
local r = decode(redis.call('GET', KEYS[1]))
local now = clock()
if not live(r, now) then
  return 0
end
local seen = ARGV[1] .. '|' .. ARGV[2]
if r.dup_last == seen then
  return 1
end
r.duplicates, r.dup_last = num(tonumber(r.duplicates or '0') + 1), seen
redis.call('SET', KEYS[1], cjson.encode(r), 'KEEPTTL')
if r.history then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'kind', 'duplicate', 'fence', r.fence or '',
    'state', ARGV[2], 'task_id', ARGV[1], 'ts', num(now))
end
return 1
""")

ENQUEUE_MARK = _script(_COMMON, """
-- KEYS[1] - enqueue-time dedup marker of the key
-- KEYS[2..n+1] - the key's run records
-- ARGV[1] - the task id about to be sent
-- ARGV[2] - marker TTL, milliseconds (a safety net if the message is lost)
-- return the task id already queued or running for the key, or false if ARGV[1] may be sent
-- (also when this call ran before and set the marker itself). A marker whose run is over (its
-- record ended, or its lease ran out unreleased: its worker died) no longer counts.
local existing = redis.call('GET', KEYS[1])
if existing and existing ~= ARGV[1] then
  local now = nil
  for i = 2, #KEYS do
    local r = decode(redis.call('GET', KEYS[i]))
    if r and r.task_id == existing then
      now = now or clock()
      if live(r, now) then
        return existing
      end
      now = -1 -- its run is over
    end
  end
  if now ~= -1 then
    return existing -- still queued: no run of it has started
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
""")

CLEAR_MARK = """
-- KEYS[1] - enqueue-time dedup marker of the key
-- ARGV[1] - the task id whose marker it must be
-- return 1 if cleared
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: how long the coalesce book of a key outlives its last change
COALESCE_KEEP_MS = 86_400_000

COALESCE = _script(_COMMON, """
-- KEYS[1..n] - the key's run records
-- KEYS[n+1] - queue of parked runs
-- KEYS[n+2] - parked messages
-- KEYS[n+3] - the coalesce book (hash: 's:<id>' -> send stamp of the pending run, 'o:<id>' -> JSON
--             list of the messages of runs it replaced, until they are answered)
-- ARGV[1] - the entry 'task id|handoff token'
-- ARGV[2] - the message to send when it is its turn
-- ARGV[3] - 'last' (a newer duplicate replaces the pending run), 'first' (it is dropped), or
--           'supersede' (as 'last', and the runs holding the key are marked superseded by it)
-- ARGV[4] - n, the number of slots
-- ARGV[5] - the run's send stamp (a whole number; '' if sent without one: it counts as the newest)
-- ARGV[6] - supersede: the grace before a superseded run is revoked, milliseconds
-- ARGV[7] - supersede: the revoke's signal name
-- The pending run is the queued entry not yet handed a slot (a reserved one is as good as
-- running; a redelivery's own copy is not a run of its own). A second run of the same call finds
-- this run parked and answers as the first did; every held record is flagged ``waiting``, so
-- its release hands the key on (the queue's hand-off, unchanged). A superseded record keeps
-- when it was first superseded (``sup_at``, and ``sup_due``: when it is revoked); ``sup_by``
-- names the newest run that superseded it.
-- return {-1} if a slot is free (acquire again);
--        {1, ms until the first holder's lease runs out, sup_due ms or '', messages...} once this
--        run is the pending one: the messages of the runs it replaced (the caller ends them,
--        then deletes 'o:<id>');
--        {2, pending task id} if this run gives way to the pending run (it does not run)
local n, mode = tonumber(ARGV[4]), ARGV[3]
local queue, parked, book = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3]
local sep = string.find(ARGV[1], '|', 1, true)
local id, stamp = string.sub(ARGV[1], 1, sep - 1), ARGV[5]
local now = clock()
local recs, left = all_held(n, now)
if not recs then
  return {-1}
end
local function owed(of)
  local raw = redis.call('HGET', book, 'o:' .. of)
  if raw then
    return cjson.decode(raw)
  end
  return {}
end
local function answer(messages)
  local out = {1, left, recs[1].sup_due or ''}
  for _, m in ipairs(messages) do
    table.insert(out, m)
  end
  return out
end
if redis.call('HGET', parked, id) then
  return answer(owed(id))
end
local pending, pending_id = nil, nil
for _, entry in ipairs(redis.call('LRANGE', queue, 0, -1)) do
  local s = string.find(entry, '|', 1, true)
  local token = string.sub(entry, s + 1)
  local reserved = is_own_copy(token)
  for i = 1, n do
    if recs[i].token == token then
      reserved = true
    end
  end
  if not reserved then
    pending, pending_id = entry, string.sub(entry, 1, s - 1)
  end
end
local replaced = {}
if pending then
  local theirs = redis.call('HGET', book, 's:' .. pending_id)
  local newer = stamp == '' or not theirs or tonumber(stamp) >= tonumber(theirs)
  if mode == 'first' or not newer then
    return {2, pending_id}
  end
  replaced = owed(pending_id)
  local msg = redis.call('HGET', parked, pending_id)
  if msg then
    table.insert(replaced, msg)
  end
  redis.call('LREM', queue, 1, pending)
  redis.call('HDEL', parked, pending_id)
  redis.call('HDEL', book, 's:' .. pending_id, 'o:' .. pending_id)
  if #replaced > 0 then
    redis.call('HSET', book, 'o:' .. id, cjson.encode(replaced))
  end
end
redis.call('RPUSH', queue, ARGV[1])
redis.call('HSET', parked, id, ARGV[2])
if stamp ~= '' then
  redis.call('HSET', book, 's:' .. id, stamp)
end
redis.call('PEXPIRE', book, """ + str(COALESCE_KEEP_MS) + """)
for i = 1, n do
  local r = recs[i]
  local changed = not r.waiting
  r.waiting = '1'
  if mode == 'supersede' then
    if not r.sup_at then
      r.sup_at, r.sup_due = num(now), num(now + tonumber(ARGV[6]))
    end
    r.sup_by, r.sup_sig, changed = id, ARGV[7], true
  end
  if changed then
    redis.call('SET', KEYS[i], cjson.encode(r), 'KEEPTTL')
  end
end
return answer(replaced)
""")

#: how long the order book of a key outlives its last change
ORDER_KEEP_MS = 86_400_000
#: how many skipped sequence numbers the order book remembers (a late arrival of one runs by arrival)
_SKIPPED_KEPT = 32

ORDER_TAKE = """
-- KEYS[1] - the order book of the key (hash)
-- ARGV[1] - the task id about to be sent
-- ARGV[2] - how long the book outlives its last change, milliseconds
-- return the task's sequence number: one more than the last one sent; a second run of the same
-- call (the last one taken) answers the same number
if redis.call('HGET', KEYS[1], 'last') == ARGV[1] then
  return tonumber(redis.call('HGET', KEYS[1], 'sent'))
end
local seq = tonumber(redis.call('HGET', KEYS[1], 'sent') or '0') + 1
redis.call('HSET', KEYS[1], 'sent', seq, 'last', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return seq
"""

_ORDER_COMMON = """
local SKIPPED_KEPT = """ + str(_SKIPPED_KEPT) + """
local function keep_book(book, queue, ms)
  redis.call('PEXPIRE', book, ms)
  redis.call('PEXPIRE', queue, ms) -- nothing if no run waits
end
-- the smallest waiting sequence number, or nil (only the commands of the documented ACL rule)
local function first_waiting(queue)
  return redis.call('ZRANGEBYSCORE', queue, '-inf', '+inf', 'LIMIT', 0, 1)[1]
end
"""

ORDER_GATE = _script(_COMMON, _ORDER_COMMON, """
-- KEYS[1] - the order book of the key (hash: 'sent', 'next', 'at', 'a', 'to', 'skipped', 'w:<seq>')
-- KEYS[2] - the sequence numbers waiting (sorted set)
-- ARGV[1] - the run's sequence number
-- ARGV[2] - this delivery: 'task id|delivery tag'
-- ARGV[3] - its message (kept while it waits for its turn)
-- ARGV[4] - order_timeout, milliseconds (kept as the key's own, 'to')
-- ARGV[5] - how long the book outlives its last change, milliseconds
-- A run goes on when every smaller number has gone on or was skipped ('next' is its number);
-- it is then *admitted* ('a'), and the next number's turn comes only when it has taken the
-- lease or entered the queue (ORDER_ADVANCE). A waiting run's message is kept in the book. A
-- second run of the admitting call answers the same; another delivery of an admitted run is
-- turned away.
-- return {1} if this run may go on now;
--        {2, ms until its predecessor counts as missing} if it waits for its turn (parked);
--        {3} if its turn was skipped (it came too late): it goes on by arrival;
--        {4} if another delivery of this run was admitted: this one does not run
local book, queue = KEYS[1], KEYS[2]
local seq, me, timeout, keep = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[5])
local admitted = redis.call('HGET', book, 'a') or ''
if admitted == ARGV[1] .. '|' .. me then
  return {1}
end
local nxt = tonumber(redis.call('HGET', book, 'next') or '1')
if seq < nxt then
  if in_list(redis.call('HGET', book, 'skipped') or '', ARGV[1]) then
    return {3}
  end
  return {4}
end
local now = clock()
redis.call('HSET', book, 'to', timeout)
if seq == nxt then
  if string.sub(admitted, 1, #ARGV[1] + 1) == ARGV[1] .. '|' then
    return {4}
  end
  redis.call('HDEL', book, 'w:' .. seq)
  redis.call('ZREM', queue, seq)
  redis.call('HSET', book, 'a', ARGV[1] .. '|' .. me, 'at', now)
  keep_book(book, queue, keep)
  return {1}
end
if not redis.call('HGET', book, 'w:' .. seq) then
  redis.call('HSET', book, 'w:' .. seq, ARGV[3])
  redis.call('ZADD', queue, seq, seq)
end
local at = tonumber(redis.call('HGET', book, 'at') or '0')
if at == 0 then
  at = now
  redis.call('HSET', book, 'at', at)
end
keep_book(book, queue, keep)
return {2, math.max(at + timeout - now, 0)}
""")

ORDER_ADVANCE = _script(_COMMON, _ORDER_COMMON, """
-- KEYS[1] - the order book of the key
-- KEYS[2] - the sequence numbers waiting
-- ARGV[1] - the admitted run's sequence number
-- ARGV[2] - its delivery: 'task id|delivery tag'
-- ARGV[3] - how long the book outlives its last change, milliseconds
-- The admitted run holds the lease or waits in the queue: the next number's turn comes.
-- return the next run's message if it waits (the caller sends it; it stays in the book until
-- that run is admitted, so the sweeper can send it again), else ''; a second run of the same
-- call answers the same
local book, queue = KEYS[1], KEYS[2]
local seq = tonumber(ARGV[1])
if redis.call('HGET', book, 'a') ~= ARGV[1] .. '|' .. ARGV[2] then
  return '' -- skipped meanwhile (it took longer than order_timeout)
end
local nxt = tonumber(redis.call('HGET', book, 'next') or '1')
if nxt == seq then
  redis.call('HSET', book, 'next', seq + 1)
elseif nxt ~= seq + 1 then
  return ''
end
local successor = redis.call('HGET', book, 'w:' .. (seq + 1))
if successor or first_waiting(queue) then
  local now = clock()
  redis.call('HSET', book, 'at', now) -- whoever waits waits for seq + 1 from now on
else
  redis.call('HDEL', book, 'at')
end
keep_book(book, queue, tonumber(ARGV[3]))
return successor or ''
""")

ORDER_SWEEP = _script(_COMMON, _ORDER_COMMON, """
-- KEYS[1] - the order book of the key
-- KEYS[2] - the sequence numbers waiting
-- ARGV[1] - order_timeout, milliseconds, unless the book has the key's own ('to', set by the gate)
-- ARGV[2] - how long the book outlives its last change, milliseconds
-- ARGV[3] - a call id unique to this look (a second run of it answers as the first did)
-- Runs wait for number ``next``. If its message is in the book (it was handed on, but has not
-- started after a whole timeout: its sender may have died before sending it), it is returned to
-- be sent again (a second copy is turned away by ORDER_GATE). If it is not, and the timeout has
-- passed since the wait began, ``next`` up to the smallest waiting number are skipped: that
-- run starts (its message is returned).
-- return {0} if nothing waits; {1, ms until the next look} if the timeout has not passed;
--        {2, message to send, first skipped number or '', last skipped number or ''}
local book, queue = KEYS[1], KEYS[2]
local timeout = tonumber(redis.call('HGET', book, 'to') or ARGV[1])
local keep = tonumber(ARGV[2])
if redis.call('HGET', book, 'sw') == ARGV[3] then
  return cjson.decode(redis.call('HGET', book, 'swa'))
end
local function answer(out)
  redis.call('HSET', book, 'sw', ARGV[3], 'swa', cjson.encode(out))
  return out
end
local first = first_waiting(queue)
local nxt = tonumber(redis.call('HGET', book, 'next') or '1')
local waiting = redis.call('HGET', book, 'w:' .. nxt)
if not first and not waiting then
  redis.call('HDEL', book, 'at')
  return {0}
end
local now = clock()
local at = tonumber(redis.call('HGET', book, 'at') or '0')
if at == 0 then
  at = now -- the wait is counted from the first look that finds it
  redis.call('HSET', book, 'at', at)
end
if now < at + timeout then
  return {1, at + timeout - now}
end
redis.call('HSET', book, 'at', now)
keep_book(book, queue, keep)
if waiting then
  return answer({2, waiting, '', ''})
end
local target = tonumber(first)
local items = {}
for item in string.gmatch(redis.call('HGET', book, 'skipped') or '', '[^,]+') do
  table.insert(items, item)
end
for s = math.max(nxt, target - SKIPPED_KEPT), target - 1 do
  table.insert(items, tostring(s))
end
while #items > SKIPPED_KEPT do
  table.remove(items, 1)
end
redis.call('HSET', book, 'skipped', table.concat(items, ','), 'next', target)
redis.call('HDEL', book, 'a') -- a late advance of a skipped run hands nothing on
return answer({2, redis.call('HGET', book, 'w:' .. target) or '', tostring(nxt), tostring(target - 1)})
""")

#: every script, for loading them all at once (the worker's start checks)
ALL_SCRIPTS = (ACQUIRE, RELEASE, RENEW_MANY, PROGRESS, PARK, JOIN, RESUME, FORCE_RELEASE, REVISE_OUTCOME,
               NOTE_DUPLICATE, ENQUEUE_MARK, CLEAR_MARK, COALESCE, ORDER_TAKE, ORDER_GATE,
               ORDER_ADVANCE, ORDER_SWEEP)
