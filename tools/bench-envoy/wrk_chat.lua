-- wrk script for `make bench-envoy` (tools/bench-envoy/bench_envoy.py): POSTs one chat body of a
-- fixed size per request and prints one machine-readable BENCH_RESULT line when the run ends.
--
-- The driver prepends three globals to a copy of this file:
--   BODY_TEMPLATE  the chat body, with a fixed-width placeholder MARK in the first message
--   MARK           the placeholder (so every body has exactly the same length)
--   NEW_PROMPT     false: every request sends the same body (prefix hit after the first);
--                  true: the placeholder becomes a per-request counter at the start of the prompt,
--                  so no prefix block is ever seen twice (new prompt).

local thread_id = 0
local counter = 0
local fixed_request = nil
local headers = { ["content-type"] = "application/json" }

local threads = {}

function setup(thread)
  -- Each wrk thread has its own Lua state; give each a distinct id so unique prompts stay unique.
  thread:set("tid", tostring(#threads))
  table.insert(threads, thread)
end

function init(args)
  thread_id = tonumber(tid) or 0
  if not NEW_PROMPT then
    local body = BODY_TEMPLATE:gsub(MARK, string.rep("0", #MARK), 1)
    fixed_request = wrk.format("POST", "/v1/chat/completions", headers, body)
  end
end

function request()
  if fixed_request then
    return fixed_request
  end
  counter = counter + 1
  -- Same width as MARK: thread id (3 digits) and counter (13 digits).
  local unique = string.format("%03d%013d", thread_id % 1000, counter)
  local body = BODY_TEMPLATE:gsub(MARK, unique, 1)
  return wrk.format("POST", "/v1/chat/completions", headers, body)
end

-- Count answers other than 200 by status (wrk itself only counts them), so a report can say
-- whether the module shed (429) or found no fresh endpoint (503).
other_statuses = {}

function response(status, headers, body)
  if status ~= 200 then
    other_statuses[status] = (other_statuses[status] or 0) + 1
  end
end

function done(summary, latency, requests)
  local statuses = {}
  for _, thread in ipairs(threads) do
    local counts = thread:get("other_statuses") or {}
    for status, n in pairs(counts) do
      statuses[status] = (statuses[status] or 0) + n
    end
  end
  local parts = {}
  for status, n in pairs(statuses) do
    table.insert(parts, string.format("%d:%d", status, n))
  end
  table.sort(parts)
  io.write(string.format(
    "BENCH_RESULT requests=%d duration_us=%d p50_us=%d p99_us=%d errors_status=%d errors_connect=%d errors_read=%d errors_write=%d errors_timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    summary.errors.status, summary.errors.connect, summary.errors.read, summary.errors.write,
    summary.errors.timeout))
  io.write("BENCH_STATUSES " .. table.concat(parts, ",") .. "\n")
end
