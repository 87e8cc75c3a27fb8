#!/bin/bash
# Mooncake's production conversation trace on real vLLM: every system, one 2-server CPU fleet
# (`bench vllm-fleet --vllm-servers 2`, already running: its fleet.json is the first argument).
# The trace's 512-token blocks become 8-token ones (`--mooncake-block-tokens 8`, lengths scaled
# alike; the bench's random words make ~2.5 of vLLM's tokens per nominal token), so its longest
# prompt (~5,000 tokens) fits the tiny model's 8,192-token context and a server's 16,384-token
# prefix cache holds about as many mean prompts (~34) as a sim's 320,000 tokens hold full-size
# ones in the 8-sim run (~26). (At 16 tokens a block the mean prompt was 962 tokens and 4 in
# 1,000 exceeded the context.)
# Usage: docs/bench/issue16/mooncake-vllm-2026-12-06/run.sh FLEET_JSON TRACE OUT [SPEEDUP] [REQUESTS] [SYSTEMS]
set -u
fleet=$(realpath "$1")
trace=$(realpath "$2")
cd "$(dirname "$0")/../../../.."
out=$3
speedup=${4:-12}
requests=${5:-1000}
systems=${6:-prefix_load,cost,oracle,vllm-router,sglang-router,smg}
mkdir -p "$out"
target/release/prefix-router bench compare --fleet vllm --vllm-fleet-file "$fleet" --model tiny-llama \
  --workload mooncake --trace "$trace" --mooncake-block-tokens 8 --speedup "$speedup" --requests "$requests" \
  --systems "$systems" --overhead-requests 0 --throughput-secs 0 --out "$out"
rm -f "$out"/*.log "$out"/backends-*.toml
