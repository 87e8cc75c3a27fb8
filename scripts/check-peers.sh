#!/usr/bin/env bash
# Starts each peer router (sglang-router, smg, vllm-router; cache_aware policy) in front of two
# `prefix-router sim` servers and checks that it accepts them as workers and routes chat and
# completions requests, streamed and not, to them. Exits non-zero if any peer fails.
set -uo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet || exit 1
bin=$(scripts/peers-venv.sh) || { echo "could not install the peers" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
s0=$(free_port); s1=$(free_port)
./target/release/prefix-router sim --servers 1 --listen "127.0.0.1:$s0" --time-scale 0 --log warn >/dev/null &
p0=$!
./target/release/prefix-router sim --servers 1 --listen "127.0.0.1:$s1" --time-scale 0 --log warn >/dev/null &
p1=$!
pids=("$p0" "$p1")
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
workers=("http://127.0.0.1:$s0" "http://127.0.0.1:$s1")
served() {  # requests the sims have finished
  local total=0 n
  for w in "${workers[@]}"; do
    n=$(curl -s "$w/metrics" | awk '/^vllm:request_success_total/ {s += $2} END {print int(s)}')
    total=$((total + n))
  done
  echo "$total"
}
chat='{"model":"sim-model","messages":[{"role":"user","content":"Hello there"}],"max_tokens":4}'
comp='{"model":"sim-model","prompt":"Once upon a time","max_tokens":4,"stream":true}'
failed=0
check() {
  local name=$1; shift
  local port metrics_port log
  port=$(free_port); metrics_port=$(free_port); log="target/check-peers-$name.log"
  "$@" --host 127.0.0.1 --port "$port" --worker-urls "${workers[@]}" --policy cache_aware \
    --prometheus-port "$metrics_port" >"$log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  local before ok=""
  before=$(served)
  for _ in $(seq 120); do
    if curl -sf -m 5 "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' -d "$chat" >/dev/null; then
      ok=1; break
    fi
    sleep 0.5
  done
  local streamed
  streamed=$(curl -s -m 10 "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' -d "$comp" | grep -c '^data: ')
  local after
  after=$(served)
  if [ -n "$ok" ] && [ "$streamed" -ge 5 ] && [ "$after" -ge $((before + 2)) ]; then
    echo "$name: ok (routed $((after - before)) requests to the sims, stream of $streamed events)"
  else
    echo "$name: FAILED (ready=${ok:-no}, stream events=$streamed, sims served $((after - before))); see $log"
    failed=1
  fi
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
}
check sglang-router "$bin/sglang-router" launch
check smg "$bin/smg" launch
check vllm-router "$bin/vllm-router"
exit $failed
