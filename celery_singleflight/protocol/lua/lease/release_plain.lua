-- RELEASE: free the run's slot, record its outcome, hand the key on (protocol/lease.py). One
-- script per release: this plain path first, then the helpers it needs and the general path.
-- KEYS[1..n] - the key's run records (n = its number of slots, #KEYS - 8; this run's is KEYS[slot])
-- KEYS[n+1] - this run's history stream
-- KEYS[n+2] - queue of parked runs
-- KEYS[n+3] - parked messages
-- KEYS[n+4] - runs joined to this run (list of their messages)
-- KEYS[n+5] - enqueue-time dedup marker (the task id queued for this key)
-- KEYS[n+6] - what earlier releases handed over (hash: releasing token -> joined messages)
-- KEYS[n+7] - the key's pause (controls): nothing is handed on while it lasts
-- KEYS[n+8] - the key's limits (controls): a slot is handed on only below its concurrency
-- ARGV[1] - the call (RELEASE_CALL, protocol/lease.py), its fields separated by \31: the run's
--           token; its outcome (succeeded, failed, retried, revoked, ...); its slot (1-based);
--           flags: '1' if the task dedups at enqueue (its marker is cleared), '2' if the run
--           raised RetryAfter, '3' both, else '0'; then, for the general path only, its fence
--           ('' for an attempt that may not have taken the key), the lease TTL of a handoff
--           reservation (ms), '1' to hand the joined runs to the caller (who gives them this
--           run's result), the run's task id (to drop the copy a redelivery parked, when the
--           lease is gone), for RetryAfter the pause (ms) and the run's queue entry, and the
--           task's max_concurrency
-- ARGV[2] - how long the record outlives the run, ms (the store's constant)
-- ARGV[3] - the history length cap (the store's constant)
-- ARGV[4] - RetryAfter: the run's own message, parked at the front of the queue ('' otherwise)
-- return {NOT_OURS} if the lease was not this run's (it ran out and another run took the key);
--        RELEASED (bare) when nothing is handed on and nobody joined: the cheapest reply to read;
--        else {RELEASED, message of the parked run now handed the key or '', joined messages...}:
--        the caller sends the message and answers the joined runs. A second run of the same call
--        answers as the first (a bare RELEASED may then come as {RELEASED, ''}).
local token, outcome, slot, flags = string.match(ARGV[1], RELEASE_CALL)
local n = #KEYS - 8
slot = tonumber(slot)
local keep, cap = ARGV[2], ARGV[3]
local history, queue, parked, joined, marker, settled =
  KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4], KEYS[n + 5], KEYS[n + 6]
local raw = redis.call('GET', KEYS[slot])
-- The plain path: the record of a plain run, as ACQUIRE wrote it (RUNNING_HEAD), with nothing
-- for this release to do but record the outcome (no history, which PROGRESS would have
-- re-encoded; no marker to clear; an outcome JSON would not escape). The text after the lease
-- fields and the previous ``rt`` (``lost``, the holder, the previous run) is kept as it is: the
-- record is neither decoded nor encoded. The answer and the record are the ones the general path
-- would give; the record opens with PLAIN too, so the next ACQUIRE reads it as text.
if raw and flags == '0' and not string.find(outcome, '[%c"\\]') then
  local head = RUNNING_HEAD(token)
  if string.find(raw, head, 1, true) == 1 then
    local fence_s, since_s, rest = string.match(raw, PLAIN_RUNNING, #head + 1)
    if fence_s then
      if string.sub(raw, rest, rest + RT_OPEN_LEN - 1) == RT_OPEN then
        rest = string.find(raw, '"', rest + RT_OPEN_LEN, true) + 2 -- the previous run's: this one's replaces it
      end
      local t = redis.call('TIME')
      local ended = t[1] .. string.sub(string.sub('00000' .. t[2], -6), 1, 3)
      -- what the next ACQUIRE reads first (RELEASED_HEAD): the releasing token, the fence, the
      -- outcome, then the holder's task id (or ``lost``), which opens the text kept as it was
      redis.call('SET', KEYS[slot], RELEASED_HEAD(token, fence_s, outcome) .. string.sub(raw, rest, -2) ..
        RELEASED_TAIL(since_s, outcome, ended, ended), 'PX', keep)
      return RELEASED
    end
  end
end
