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
