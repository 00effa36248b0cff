-- EPOCH: one more look at the namespace's epoch (protocol/epoch.py)
-- KEYS[1] - the epoch (string: '<life> <count>')
-- ARGV[1] - a new life, taken only if the key is missing (Redis lost it, or this is the first look)
-- Every worker's sweeper counts once per look and remembers what it got: intact data answers
-- the same life and a larger count; a new life (restarted empty) or a count not larger than the
-- last one seen (an older snapshot, a lagging replica) says data was lost. A second run of a
-- look counts once more: the caller keeps its answer, which is still larger than the last.
-- return {life, count}
local raw = redis.call('GET', KEYS[1])
local life, count = ARGV[1], 0
if raw then
  local sep = string.find(raw, ' ', 1, true)
  life, count = string.sub(raw, 1, sep - 1), tonumber(string.sub(raw, sep + 1))
end
count = count + 1
redis.call('SET', KEYS[1], life .. ' ' .. string.format('%d', count))
return {life, count}
