#!/usr/bin/env bash
# Concurrency and soak, through `prefix-router serve` in front of simulated vLLM servers:
#   1. 2,000 concurrent streaming clients;
#   2. 100,000 requests at sustained load, RSS recorded after 10,000 and after 100,000.
# Checks: no errors, no request lost or completed twice (client successes = the sims' finished
# requests), in-flight back to 0, no file-descriptor growth. Usage: scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ulimit -n 65536
cargo build --release --quiet
bin=./target/release/prefix-router
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
sim_port=$(free_port); router_port=$(free_port)
# Realistic time: 8 ms between tokens, 20k prefill tokens/s; 4 servers of 1,024 seats.
$bin sim --servers 4 --listen "127.0.0.1:$sim_port" --max-num-seqs 1024 --log warn >/dev/null &
sim_pid=$!
sleep 1
sims=(); for i in 0 1 2 3; do sims+=("http://127.0.0.1:$((sim_port + i))"); done
backend_args=(); for s in "${sims[@]}"; do backend_args+=(--backend "$s"); done
$bin serve --listen "127.0.0.1:$router_port" "${backend_args[@]}" --capacity 4096 --log warn >/dev/null 2>&1 &
router_pid=$!
trap 'kill $router_pid $sim_pid 2>/dev/null; wait 2>/dev/null || true' EXIT
router="http://127.0.0.1:$router_port"
for _ in $(seq 50); do curl -sf "$router/health" >/dev/null && break; sleep 0.1; done
sim_args=(); for s in "${sims[@]}"; do sim_args+=(--sim-url "$s"); done

rss() { awk '/VmRSS/ {print $2 " kB"}' "/proc/$router_pid/status"; }
fds() { ls "/proc/$router_pid/fd" | wc -l; }
finished() { local t=0 n; for s in "${sims[@]}"; do n=$(curl -s "$s/metrics" | awk '/^vllm:request_success_total/ {x += $2} END {print int(x)}'); t=$((t + n)); done; echo $t; }
inflight() { curl -s "$router/metrics" | awk '/^prefix_router_inflight\{/ {x += $2} END {print int(x)}'; }
run() {  # run LABEL ARGS...: prints the bench table and returns its results.json path
  local label=$1; shift
  local out="target/soak-$label"
  $bin bench run --url "$router" "${sim_args[@]}" --out "$out" "$@" >/dev/null
  python3 -c "import json,sys; r=json.load(open('$out/results.json'))[0]; print(f\"  {r['requests']} requests, {r['errors']} errors, {r['throughput_rps']:.0f} req/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms p99 {r['ttft_p99_ms']:.1f} ms\"); sys.exit(1 if r['errors'] else 0)"
}

echo "idle: RSS $(rss), fds $(fds)"
base=$(finished)
echo "== 2,000 concurrent streaming clients (20,000 requests, 256-token prompts, 64 tokens each)"
run concurrency --workload random --random-count 20000 --input-len 256 --output-len 64 --concurrency 2000
sleep 1
echo "after: RSS $(rss), fds $(fds), in flight $(inflight), completed at the sims $(( $(finished) - base )) of 20000"

echo "== soak: 100,000 requests, 200 clients"
base=$(finished)
run soak-10k --workload random --random-count 10000 --input-len 256 --output-len 16 --concurrency 200 --seed 2
echo "after 10,000: RSS $(rss), fds $(fds)"
run soak-90k --workload random --random-count 90000 --input-len 256 --output-len 16 --concurrency 200 --seed 3
sleep 1
echo "after 100,000: RSS $(rss), fds $(fds), in flight $(inflight), completed at the sims $(( $(finished) - base )) of 100000"
