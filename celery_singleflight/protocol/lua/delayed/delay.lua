-- DELAY: keep a copy of a run delayed until its due time (protocol/delayed.py). Its countdown
-- message is sent too; the copy is sent by a sweeper only if that message is lost (see RESEND).
-- KEYS[1] - the key's delayed runs (hash: task id -> entry)
-- KEYS[2] - when claimed entries may go (sorted set: task id -> ms)
-- KEYS[3] - the journal marks of runs waiting on the key (protocol/epoch.py)
-- ARGV[1] - the run's task id
-- ARGV[2] - the token its countdown message carries (unique to this delay: a replay carries it)
-- ARGV[3] - its message, without the token
-- ARGV[4] - the countdown, milliseconds
-- ARGV[5] - '1' to put back a copy Redis lost (the recovery): written only if the run has no entry
--           (it started, or was delayed again, meanwhile: that entry stands)
-- ARGV[6] - the run's journal mark ('' if it is not journaled)
-- ARGV[7] - the token of the caller's claim, if it delays the run it claimed: it must still hold
--           that claim (a sweeper may have taken it back: then another copy runs the run). A
--           copy not claimed whose token is current is the caller's, as in CLAIM_DONE: its claim
--           found no entry (Redis lost it) and the recovery put the copy back under that token
-- A run delayed again replaces its entry (its earlier copies are stale from then on). Running
-- this twice writes nothing more, also once the run's copies moved on (a sweeper sent one, which
-- claimed and started while this call's reply was lost and redis-py sent it again): a token the
-- entry knows, current or stale, is this call's own.
-- return {DELAYED, due ms}, or {NOT_CLAIMED} (another copy owns the run now: the caller's claim
--        was taken back, or this call, sent again, found a copy that claimed it; nothing written)
local id, token = ARGV[1], ARGV[2]
local e = entry_of(KEYS[1], id)
if e and (has_token(e, token) or is_old(e, token) or e.c == token or ARGV[5] == '1') then
  if ARGV[5] ~= '1' and e.c and e.c ~= token then
    return {NOT_CLAIMED} -- sent again after a copy of the run claimed it: that copy owns the run
  end
  return {DELAYED, tonumber(e.due)}
end
local claimed = ARGV[7]
if e and claimed and claimed ~= '' and ((e.c and e.c ~= claimed) or (not e.c and not has_token(e, claimed))) then
  return {NOT_CLAIMED}
end
local now = clock()
local due = now + tonumber(ARGV[4])
prune(KEYS[1], KEYS[2], now)
delayed_entry(KEYS[1], KEYS[2], id, token, due, ARGV[3], nil)
journaled(KEYS[3], ARGV[6], now)
keep_for(KEYS[1], tonumber(ARGV[4]) + DELAYED_KEEP_MS)
keep_for(KEYS[2], tonumber(ARGV[4]) + DELAYED_KEEP_MS)
return {DELAYED, due}
