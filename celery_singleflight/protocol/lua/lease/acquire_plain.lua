-- ACQUIRE: take a free slot of the key, or learn who holds it (protocol/lease.py). One script
-- per acquire: this plain path first, then the helpers it needs and the general path.
-- KEYS[1..n] - the key's run records, one per slot (n = max_concurrency, usually 1; #KEYS - 6)
-- KEYS[n+1]  - queue of parked runs (list of 'task id|handoff token')
-- KEYS[n+2]  - parked messages (hash: task id -> message)
-- KEYS[n+3]  - enqueue-time dedup marker (a dead holder's is removed)
-- KEYS[n+4]  - handoff tokens of parked runs that took their slot (sorted set: token -> ms)
-- KEYS[n+5]  - the key's pause (controls: '<until ms>', 0 until resumed)
-- KEYS[n+6]  - the key's limits set at run time (controls: 'c=<n> p=<peak> ...')
-- ARGV[1] - the call (ACQUIRE_CALL, protocol/lease.py), its fields separated by \31: the token
--           unique to this execution; the lease TTL, ms; the record's expiry (PX: the TTL plus
--           how long the record outlives its lease, sent ready); the handoff token this run was
--           sent with ('' if it was never parked); the token of an earlier attempt whose reply
--           never came ('' if none); then, for the general path only, how long the record
--           outlives its lease (ms), the holder's task id and the task's max_concurrency
-- ARGV[2] - the holder's fields, JSON object members without braces
-- ARGV[3] - the holder's trace context (W3C traceparent); not sent when its run is not traced
-- return 'fence:since ms:slot' if acquired (one string: the cheapest reply to read; slot counts
--        from 0), also when this is a second run of the same call;
--        {TOOK, 'fence:since ms:slot', and the task id, worker and task name of the run whose
--        lease ran out unreleased on that slot} if acquired in place of a dead holder (the caller
--        ends its run; a second run of the call names it again);
--        {HELD, holder task id, lease ms left, its trace context or ''} if every slot is held
--        (the holder whose lease ends first);
--        {HANDED_ON, its task id, reservation ms, message, and the task id, worker and task name of
--        the run whose lease ran out unreleased on that slot, or ''} if a slot was free but handed
--        to the first parked run (the caller sends its message, and ends the dead run's);
--        {ADOPTED} if this run was parked and took its slot before: this message is another copy;
--        {FOREIGN, version} if a record of the key was written by another protocol version;
--        {PAUSED, ms left or -1 (until resumed)} if the key is paused (the caller parks the run);
--        {MORE_SLOTS, slots} if its limits allow more slots than were named (call again so)
local token, ttl, px, handoff, earlier = string.match(ARGV[1], ACQUIRE_CALL)
local trace = ARGV[3] and TRACE_FIELD(ARGV[3]) or ''
local n = #KEYS - 6
local queue, parked, marker, adopted = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4]
-- the record, the pause and the limits in one command: the plain path costs no more for them
local got = redis.call('MGET', KEYS[1], KEYS[n + 5], KEYS[n + 6])
local first, paused, limits = got[1], got[2], got[3]
if n == 1 and handoff == '' and earlier == '' and not paused and not limits then
  -- The plain path: one slot, a run never parked, and a key with no record (nobody held it
  -- lately) or with the record a plain run's release left (it opens with PLAIN, see RELEASE).
  -- What the general path would do, reading that record as text (PLAIN_RELEASED: what is read
  -- comes first; a pattern costs the server per byte) and the clock's digits as they come.
  local rt, fence, outcome, prev_id = '', nil, nil, nil
  if first then
    rt, fence, outcome, prev_id = string.match(first, PLAIN_RELEASED)
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
      rt = RT_FIELD(rt)
      extra = PREVIOUS_FIELDS(prev_id, outcome)
    end
    local deadline = string.format('%d', since + ttl)
    redis.call('SET', KEYS[1], PLAIN_RUNNING_RECORD(token, new_fence, since, deadline) .. rt .. ARGV[2] ..
      trace .. extra .. '}', 'PX', px)
    return new_fence .. ':' .. since .. ':0'
  end
end
