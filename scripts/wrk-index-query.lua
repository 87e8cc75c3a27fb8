-- wrk script: POST /v1/query with an 8 KiB request against 64 candidate servers.
-- The request is the one bench-index-http.sh notified last, so the query walks all 64 chunks.
local ids = {}
for i = 0, 63 do ids[#ids + 1] = tostring(i) end
local text = string.rep("0123456789abcdef", 512)  -- 8 KiB
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"request":"' .. text .. '","server_ids":[' .. table.concat(ids, ",") .. ']}'
