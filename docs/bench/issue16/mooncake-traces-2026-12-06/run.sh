#!/bin/bash
# Issue 16's Mooncake goal on both of Mooncake's public FAST'25 traces that GitHub serves in full:
# conversation_trace.jsonl (Kimi's production conversation traffic) and synthetic_trace.jsonl.
# (toolagent_trace.jsonl is stored with Git LFS there and its content is not served.)
# Usage: docs/bench/issue16/mooncake-traces-2026-12-06/run.sh TRACE_DIR [OUT]
#   TRACE_DIR holds the two files from kvcache-ai/Mooncake FAST25-release/traces/; OUT, from the
#   repository's root, defaults to this directory. About 40 minutes: every system, 8 sims, the
#   first 1,000 requests of each trace at twice their recorded speed.
set -u
traces=$(realpath "$1")
cd "$(dirname "$0")/../../../.."
out=${2:-docs/bench/issue16/mooncake-traces-2026-12-06}
mkdir -p "$out"
exe=target/release/prefix-router
common="--sim-servers 8 --systems prefix_load,cost,oracle,vllm-router,sglang-router,smg --overhead-requests 0 --throughput-secs 0"
cargo build --release --quiet
for t in conversation synthetic; do
  # shellcheck disable=SC2086
  $exe bench compare --workload mooncake --trace "$traces/${t}_trace.jsonl" --requests 1000 --speedup 2 \
    --sim-args "--kv-blocks 20000" $common --out "$out/$t"
done
