#!/usr/bin/env bash
# Concurrency and soak, through `prefix-router serve` in front of simulated vLLM servers:
#   1. 2,000 concurrent streaming clients;
#   2. 100,000 requests at sustained load, RSS recorded after 10,000 and after 100,000.
# Checks: no errors, no request lost or completed twice (client successes = the sims' finished
# requests), in-flight back to 0, no file-descriptor growth.
# Usage: scripts/soak.sh [all|concurrency|soak]
set -euo pipefail
cd "$(dirname "$0")/.."
phases=${1:-all}
ulimit -n "$(ulimit -Hn)"  # 2,000 clients need ~4,000 descriptors in the router, as many in the driver
[ "$(ulimit -n)" = unlimited ] || [ "$(ulimit -n)" -ge 8192 ] || { echo "needs at least 8192 open files (ulimit -n)" >&2; exit 1; }
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

rss_kb() { awk '/VmRSS/ {print $2}' "/proc/$router_pid/status"; }
rss() { echo "$(rss_kb) kB"; }
peak_rss() { awk '/VmHWM/ {print $2 " kB"}' "/proc/$router_pid/status"; }
fds() { ls "/proc/$router_pid/fd" | wc -l; }
finished() { local t=0 n; for s in "${sims[@]}"; do n=$(curl -s "$s/metrics" | awk '/^vllm:request_success_total/ {x += $2} END {print int(x)}'); t=$((t + n)); done; echo $t; }
inflight() { curl -s "$router/metrics" | awk '/^prefix_router_inflight\{/ {x += $2} END {print int(x)}'; }
fail() { echo "FAIL: $*" >&2; exit 1; }
# check_after LABEL EXPECTED BASE: every request completed exactly once at the sims, nothing left
# in flight, descriptors and RSS back to their idle values (idle_fds, idle_rss).
check_after() {
  local label=$1 expected=$2 base=$3
  local done_now; done_now=$(( $(finished) - base ))
  local left; left=$(inflight)
  local fd_now; fd_now=$(fds)
  echo "after $label: RSS $(rss) (peak so far $(peak_rss)), fds $fd_now, in flight $left, completed at the sims $done_now of $expected"
  [ "$done_now" -eq "$expected" ] || fail "$label: the sims completed $done_now requests, the clients sent $expected (lost or duplicated)"
  [ "$left" -eq 0 ] || fail "$label: $left requests still in flight"
  # Idle upstream connections stay pooled for 4 s; after that the descriptors must be back.
  local waited=0
  while [ "$(fds)" -gt $((idle_fds + 64)) ] && [ $waited -lt 180 ]; do sleep 5; waited=$((waited + 5)); done
  fd_now=$(fds)
  echo "  $waited s later: RSS $(rss), fds $fd_now"
  [ "$fd_now" -le $((idle_fds + 64)) ] || fail "$label: $fd_now open descriptors against $idle_fds idle"
  # Freed memory goes back to the system within jemalloc's decay time (10 s dirty + 10 s muzzy);
  # what stays is the index (bounded by --capacity), metrics and runtime slabs.
  waited=0
  while [ "$(rss_kb)" -gt $((idle_rss + 16384)) ] && [ $waited -lt 60 ]; do sleep 5; waited=$((waited + 5)); done
  echo "  $waited s later: RSS $(rss) (idle $idle_rss kB)"
  [ "$(rss_kb)" -le $((idle_rss + 16384)) ] || fail "$label: RSS $(rss) has not come back to within 16 MiB of idle"
}
run() {  # run LABEL ARGS...: one bench run; prints its summary, fails on any error
  local label=$1; shift
  local out="target/soak-$label"
  $bin bench run --url "$router" "${sim_args[@]}" --out "$out" "$@" >/dev/null
  python3 -c "import json,sys; r=json.load(open('$out/results.json'))['systems'][0]; print(f\"  {r['requests']} requests, {r['errors']} errors, {r['throughput_rps']:.0f} req/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms p99 {r['ttft_p99_ms']:.1f} ms\"); sys.exit(1 if r['errors'] else 0)"
}

idle_fds=$(fds); idle_rss=$(rss_kb)
echo "idle: RSS $(rss), fds $idle_fds"
if [ "$phases" != soak ]; then
base=$(finished)
echo "== 2,000 concurrent streaming clients (20,000 requests, 256-token prompts, 64 tokens each)"
run concurrency --workload random --random-count 20000 --input-len 256 --output-len 64 --concurrency 2000
sleep 2  # let idle client connections close
check_after "2,000 concurrent" 20000 "$base"
fi
[ "$phases" = concurrency ] && exit 0

echo "== soak: 100,000 requests, 200 clients"
base=$(finished)
run soak-10k --workload random --random-count 10000 --input-len 256 --output-len 16 --concurrency 200 --seed 2
echo "after 10,000: RSS $(rss), fds $(fds)"
run soak-90k --workload random --random-count 90000 --input-len 256 --output-len 16 --concurrency 200 --seed 3
sleep 2
check_after "100,000" 100000 "$base"
echo "soak passed"
