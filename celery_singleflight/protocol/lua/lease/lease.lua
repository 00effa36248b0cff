-- Helpers of the lease's own scripts.
--
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
