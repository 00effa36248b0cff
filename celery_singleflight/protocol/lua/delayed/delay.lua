-- DELAY: keep a copy of a run delayed until its due time (protocol/delayed.py). Its countdown
-- message is sent too; the copy is sent by a sweeper only if that message is lost (see RESEND).
-- KEYS[1] - the key's delayed runs (hash: task id -> entry)
-- KEYS[2] - when claimed entries may go (sorted set: task id -> ms)
-- ARGV[1] - the run's task id
-- ARGV[2] - the token its countdown message carries (unique to this delay: a replay carries it)
-- ARGV[3] - its message, without the token
-- ARGV[4] - the countdown, milliseconds
-- ARGV[5] - '1' to put back a copy Redis lost (the recovery): written only if the run has no entry
--           (it started, or was delayed again, meanwhile: that entry stands)
-- A run delayed again replaces its entry (its earlier copies are stale from then on); running
-- this twice writes the same entry, due when the first run said.
-- return {DELAYED, due ms}
local id, token = ARGV[1], ARGV[2]
local e = entry_of(KEYS[1], id)
if e and (e.t == token or ARGV[5] == '1') then
  return {DELAYED, tonumber(e.due)}
end
local now = clock()
local due = now + tonumber(ARGV[4])
prune(KEYS[1], KEYS[2], now)
delayed_entry(KEYS[1], KEYS[2], id, token, due, ARGV[3], nil)
keep_for(KEYS[1], tonumber(ARGV[4]) + DELAYED_KEEP_MS)
keep_for(KEYS[2], tonumber(ARGV[4]) + DELAYED_KEEP_MS)
return {DELAYED, due}
