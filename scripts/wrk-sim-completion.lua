-- wrk script: POST /v1/completions with a 1 KiB prompt, 16 output tokens, not streamed.
-- Each connection uses its own prompt so that the cache sees both hits and misses.
local counter = 0
function setup(thread)
  counter = counter + 1
  thread:set("id", counter)
end
function init(args)
  local prompt = string.rep("The quick brown fox jumps over the lazy dog " .. id .. ". ", 23)
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  wrk.body = '{"model":"sim-model","prompt":"' .. prompt .. '","max_tokens":16,"ignore_eos":true}'
end
