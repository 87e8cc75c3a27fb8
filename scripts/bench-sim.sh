#!/usr/bin/env bash
# Requests/s one `prefix-router sim` process sustains at --time-scale 0 (no simulated waiting),
# loaded by wrk over loopback. Usage: scripts/bench-sim.sh [seconds] [connections]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
conns=${2:-32}
command -v wrk >/dev/null || { echo "wrk is needed: apt-get install wrk" >&2; exit 1; }
cargo build --release --quiet
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
./target/release/prefix-router sim --servers 1 --listen "127.0.0.1:$port" --time-scale 0 --log warn &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
wrk -t2 -c"$conns" -d"${secs}s" --latency -s scripts/wrk-sim-completion.lua "http://127.0.0.1:$port/v1/completions"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^vllm:(request_success_total|prefix_cache_(hits|queries)_total)'
