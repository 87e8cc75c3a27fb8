#!/bin/bash
# Issue 16's goals table on 8 sims, without Mooncake: every system on five workloads (the README's commands).
# Usage: docs/bench/issue16/goals-2026-12-06/run.sh [OUT]  (about 20-25 minutes; OUT, from the
# repository's root, defaults to this directory)
set -u
cd "$(dirname "$0")/../../../.."
out=${1:-docs/bench/issue16/goals-2026-12-06}
mkdir -p $out
exe=target/release/prefix-router
common="--sim-servers 8 --systems prefix_load,cost,oracle,vllm-router,sglang-router,smg --overhead-requests 0 --throughput-secs 0"
cargo build --release --quiet
python3 scripts/agent-trace.py target/agent.jsonl
for w in multi-turn shared-prefix prefix-repetition bursty; do
  $exe bench compare --workload "$w" --sim-args "--kv-blocks 3000" $common --out "$out/$w"
done
$exe bench compare --workload trace --trace target/agent.jsonl --sim-args "--kv-blocks 3000" $common --out "$out/agent"
