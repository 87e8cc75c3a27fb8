#!/usr/bin/env bash
# Requests/s of POST /v1/query (8 KiB request, 64 candidates) on `prefix-router index`,
# loaded by wrk over loopback. Usage: scripts/bench-index-http.sh [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
conns=${2:-64}
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
cargo build --release --quiet
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
./target/release/prefix-router index --listen "127.0.0.1:$port" --log warn &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
# 64 servers with 200 distinct 8 KiB requests each (~820k entries), then the queried one on 63.
python3 - "$port" <<'PY'
import json, sys, urllib.request, random
port = sys.argv[1]
rnd = random.Random(1)
def post(body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/notify", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()
for n in range(64 * 200):
    text = rnd.randbytes(4096).hex()
    post({"request": text, "server_id": n % 64})
post({"request": "0123456789abcdef" * 512, "server_id": 63})
PY
curl -s "http://127.0.0.1:$port/v1/servers" | python3 -c 'import json,sys; s=json.load(sys.stdin)["servers"]; print(len(s), "servers,", sum(x["chunks"] for x in s), "entries")'
wrk -t2 -c"$conns" -d"${secs}s" --latency -s scripts/wrk-index-query.lua "http://127.0.0.1:$port/v1/query"
