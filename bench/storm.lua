-- wrk script for bench_receiver.py: POST one alert body over and over on every connection
-- (wrk -s bench/storm.lua URL -- BODY_FILE [HEADER_FILE]), and print a JSON summary at the end.
-- HEADER_FILE holds extra "Name: value" lines (an Authorization header, a signature). No
-- response() hook: it would make wrk parse every answer's body; errors.status counts non-2xx.

local body_path, header_path = nil, nil

function init(args)
   body_path, header_path = args[1], args[2]
   local f = assert(io.open(body_path, "rb"))
   wrk.body = f:read("*a")
   f:close()
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
   if header_path then
      for line in io.lines(header_path) do
         local name, value = line:match("^([^:]+):%s*(.*)$")
         if name then wrk.headers[name] = value end
      end
   end
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "max_us": %d, ' ..
      '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}}\n',
      summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.max,
      e.connect, e.read, e.write, e.status, e.timeout))
end
