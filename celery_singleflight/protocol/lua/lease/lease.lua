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
-- ACQUIRE: a reservation for ``handoff`` on ``slot`` while the run that adopted that token before
-- still holds its lease on another slot (its fence is the adopted one): a second reservation
-- for one run (a fair run's first ran out while its message was slow, and a copy was reserved
-- another): the copy must not adopt it
local function holds_elsewhere(adopted, handoff, recs, n, slot, now)
  local fence = redis.call('ZSCORE', adopted, handoff)
  for i = 1, n do
    local r = recs[i]
    if fence and i ~= slot and live(r, now) and not r.reserved and r.fence == fence then
      return true
    end
  end
  return false
end
-- ACQUIRE: what a slot's new record carries of its previous one ``prev``: who ran before and how
-- it ended (and the joined flag), the fences of lost leases (a dead holder's added), and a
-- supersede a parked run learnt on its way (``adopting``); and the dead holder it replaces (its
-- lease ran out unreleased: the caller ends its run; a replay names it again), if runs waited on
-- it (flagged, or the taker was parked: ``waited``) and it is not the taking run ``id`` itself (a
-- holder nobody waited on may only have frozen; its own end stands)
local function carried_over(prev, now, adopting, marker, id, waited)
  local extra, lost, carried, dead = '', '', '', false
  if prev then
    local prev_id, prev_outcome = previous(prev, now)
    if prev_id then
      extra = ',"prev_task_id":' .. cjson.encode(prev_id) .. ',"prev_outcome":' .. cjson.encode(prev_outcome or '')
    end
    lost = prev.lost or ''
    if expired(prev, now) and not adopting then
      lost = add_lost(lost, prev.fence)
      forget_dead(marker, prev)
      if prev.task_id ~= id and (prev.waiting or prev.joined or waited) then
        dead = prev
        extra = extra .. ',"prev_worker":' .. cjson.encode(prev.worker or '') .. ',"prev_task_name":' ..
          cjson.encode(prev.task_name or '')
      end
    end
    if prev.joined then
      extra = extra .. JOINED_FLAG
    end
    if adopting then
      carried = superseded_on_the_way(prev)
    end
  end
  return extra, lost, carried, dead
end
