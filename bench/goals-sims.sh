#!/bin/bash
# The headline comparison on 8 simulated H100-like servers: the default policy (`cost`),
# `prefix_load`, the oracle and the three PyPI peers, every system in one `bench compare` per
# workload (multi-turn, shared-prefix, prefix-repetition, bursty, and the agent trace).
# Usage: bench/goals-sims.sh [OUT]   (about 20-25 minutes; OUT defaults to
# bench-results/goals-sims, which git ignores)
set -eu
cd "$(dirname "$0")/.."
out=${1:-bench-results/goals-sims}
mkdir -p "$out"
exe=target/release/prefix-router
common="--sim-servers 8 --systems prefix_load,cost,oracle,vllm-router,sglang-router,smg --overhead-requests 0 --throughput-secs 0"
cargo build --release --quiet
python3 scripts/agent-trace.py target/agent.jsonl
for w in multi-turn shared-prefix prefix-repetition bursty; do
  # shellcheck disable=SC2086
  $exe bench compare --workload "$w" --sim-args "--kv-blocks 3000" $common --out "$out/$w"
done
# shellcheck disable=SC2086
$exe bench compare --workload trace --trace target/agent.jsonl --sim-args "--kv-blocks 3000" $common --out "$out/agent"
