-- Helpers of newest-wins (``supersede``) that the lease's own scripts call: a superseded record
-- carries ``sup_by`` (the newest run that took over), ``sup_at``, ``sup_due`` and ``sup_sig``.
--
-- ACQUIRE: a run adopting its reservation that a newer run superseded on its way starts
-- superseded: the fields it carries over (JSON members, '' if none)
local function superseded_on_the_way(prev)
  if not prev.sup_by then
    return ''
  end
  local by, sig = cjson.encode(prev.sup_by), cjson.encode(prev.sup_sig or 'SIGTERM')
  local at, due = prev.sup_at, prev.sup_due
  return SUPERSEDED_FIELDS(by, at, due, sig)
end
-- RELEASE: a run stopped, revoked or failed after a newer run took over ended ``superseded``
local function superseded_outcome(r, outcome)
  if r.sup_by and outcome ~= 'succeeded' then
    return 'superseded'
  end
  return outcome
end
-- RENEW: the code of a renewed lease (its record as text)
local function renewal(raw)
  if string.find(raw, SUPERSEDED_MARK, 1, true) then
    return RENEWED_SUPERSEDED
  end
  return RENEWED
end
-- PROGRESS: the answer of a written update
local function progress_answer(r, entry)
  if r.sup_by then
    return {WRITTEN_SUPERSEDED, r.sup_by}
  end
  return {WRITTEN, entry}
end
-- COALESCE: the messages of the runs ``of`` replaced, kept in the book until they are answered
local function owed(book, of)
  local raw = redis.call('HGET', book, 'o:' .. of)
  if raw then
    return cjson.decode(raw)
  end
  return {}
end
-- COALESCE, NEWEST_START: the task id of a run sent after ``stamp`` that is already pending or
-- started (the book's ``latest``: '<stamp> <task id>'), if there is one; a run sent by name
-- (no stamp) counts as the newest
local function newer_run(book, stamp, id)
  local latest = redis.call('HGET', book, 'latest')
  if stamp == '' or not latest then
    return nil
  end
  local sep = string.find(latest, ' ', 1, true)
  local their_stamp, their_id = tonumber(string.sub(latest, 1, sep - 1)), string.sub(latest, sep + 1)
  if their_id ~= id and their_stamp > tonumber(stamp) then
    return their_id
  end
  return nil
end
-- COALESCE, NEWEST_START: remember the run sent last that is pending or started
local function note_latest(book, stamp, id)
  if stamp ~= '' then
    redis.call('HSET', book, 'latest', stamp .. ' ' .. id)
    redis.call('PEXPIRE', book, NEWEST_KEEP_MS)
  end
end
