-- Helpers of the time policies (``debounce``, ``key_rate_limit``).
local function clock_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function ms_text(x)
  return string.format('%.0f', x)
end
