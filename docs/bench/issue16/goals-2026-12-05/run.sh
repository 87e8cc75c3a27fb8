#!/bin/bash
# Issue 16's goals table on 8 sims: every system on every workload (the README's commands).
# Usage: docs/bench/issue16/goals-2026-12-05/run.sh MOONCAKE_SYNTHETIC_TRACE [OUT_DIR]
#   (synthetic_trace.jsonl from kvcache-ai/Mooncake FAST25-release/traces/; OUT_DIR default bench-results/goals)
set -euo pipefail
trace=$(realpath "$1")
cd "$(dirname "$0")/../../../.."
out="${2:-bench-results/goals}"
mkdir -p "$out"
cargo build --release --quiet
exe=target/release/prefix-router
common="--sim-servers 8 --systems prefix_load,cost,oracle,vllm-router,sglang-router,smg --overhead-requests 0 --throughput-secs 0"
python3 scripts/agent-trace.py "$out/agent.jsonl"
for w in shared-prefix multi-turn prefix-repetition bursty; do
  # shellcheck disable=SC2086
  "$exe" bench compare --workload "$w" --sim-args "--kv-blocks 3000" $common --out "$out/$w"
done
# shellcheck disable=SC2086
"$exe" bench compare --workload trace --trace "$out/agent.jsonl" --sim-args "--kv-blocks 3000" $common --out "$out/agent"
# shellcheck disable=SC2086
"$exe" bench compare --workload mooncake --trace "$trace" --requests 1000 --speedup 2 --sim-args "--kv-blocks 20000" $common --out "$out/mooncake"
