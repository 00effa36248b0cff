-- Helpers of the push to a holder's process (protocol/inbox.py).
--
-- COALESCE (supersede), FORCE_RELEASE: tell the process of the run holding record ``r`` (stored
-- under ``run_key``) at once that its lease was superseded or taken away: one PUBLISH on its
-- process's inbox channel, '<namespace>:inbox:<host>:<pid>', in the same atomic step as the change.
-- A push nobody hears loses nothing (the holder's renewal learns the same); a second run of the
-- script pushes again, and the holder ignores what it knows. A reservation has no process yet.
-- ``redis.pcall``: a user whose ACL allows no channel still supersedes and force-releases.
local function tell_holder(run_key, r, news)
  if r.token and not r.reserved and r.host and r.pid then
    local ns = string.sub(run_key, 1, string.find(run_key, ':{', 1, true) - 1)
    redis.pcall('PUBLISH', ns .. ':' .. INBOX .. ':' .. r.host .. ':' .. r.pid,
                run_key .. '\31' .. r.token .. '\31' .. news)
  end
end
