-- RENEW: extend every lease a process holds, in one call (protocol/lease.py; the heartbeat).
-- KEYS[2i-1] - run record of lease i
-- KEYS[2i]   - its history stream
-- ARGV[2i-1] - token of lease i
-- ARGV[2i]   - new TTL of lease i, milliseconds
-- ARGV[#ARGV] - how long a record outlives its lease, milliseconds
-- return a list with, per lease, RENEWED; RENEWED_SUPERSEDED (renewed, but a newer run took
-- over: the holder must stop); or GONE (it is no longer this run's)
local keep = tonumber(ARGV[#ARGV])
local now = clock()
local out = {}
for i = 1, #KEYS / 2 do
  local raw = redis.call('GET', KEYS[2 * i - 1])
  -- the token is hex: a plain search finds exactly the token field (quotes inside values are escaped)
  local token = ARGV[2 * i - 1]
  if raw and string.find(raw, TOKEN_FIELD(token), 1, true) then
    local ttl = tonumber(ARGV[2 * i])
    local deadline = num(now + ttl)
    raw = string.gsub(raw, DEADLINE_MATCH, DEADLINE_FIELD(deadline), 1)
    redis.call('SET', KEYS[2 * i - 1], raw, 'PX', ttl + keep)
    if string.find(raw, HISTORY_FLAG, 1, true) then
      redis.call('PEXPIRE', KEYS[2 * i], ttl + keep)
    end
    out[i] = renewal(raw)
  else
    out[i] = GONE
  end
end
return out
