-- Helpers of the time policies (``debounce``, ``key_rate_limit``).
local function clock_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function ms_text(x)
  return string.format('%.0f', x)
end
-- DEBOUNCE_CALL, DEBOUNCE_DUE: the call's arguments become the burst's, unless the burst has those
-- of a call sent later (``sent``, ``newest``: send times, ms; '' or nil if unknown)
local function take_payload(burst, payload, sent, newest)
  if sent ~= '' and newest and tonumber(newest) > tonumber(sent) then
    return
  end
  redis.call('HSET', burst, 'payload', payload)
  if sent ~= '' then
    redis.call('HSET', burst, 'sent', sent)
  end
end
