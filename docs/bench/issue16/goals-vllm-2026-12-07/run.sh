#!/bin/bash
# Issue 16's goals on real vLLM: the default policy (`cost`), `prefix_load`, the oracle and the
# three PyPI peers on the CPU fleet's four workloads (scripts/vllm-workloads.sh), every system in
# one `bench compare` per workload. The fleet's speed drifts between runs, so ROUNDS rounds, the
# systems' order reversed every other round. Needs a running fleet (`prefix-router bench
# vllm-fleet --vllm-servers 2 --work-dir target/vllm-fleet`, warmed by one discarded run) and
# the peers (scripts/peers-venv.sh). OUT/round-N/WORKLOAD: the runs.
# Usage: docs/bench/issue16/goals-vllm-2026-12-07/run.sh OUT [ROUNDS]   (about 20 minutes a round)
set -eu
out=$1
rounds=${2:-2}
exe=target/release/prefix-router
systems=cost,prefix_load,oracle,vllm-router,sglang-router,smg
reversed=smg,sglang-router,vllm-router,oracle,prefix_load,cost
# shellcheck source=scripts/vllm-workloads.sh
. scripts/vllm-workloads.sh
for round in $(seq 1 "$rounds"); do
  order=$systems
  [ $((round % 2)) -eq 0 ] && order=$reversed
  for w in shared-prefix multi-turn prefix-repetition bursty; do
    # shellcheck disable=SC2046
    "$exe" bench compare --workload "$w" $(args_for "$w") --model tiny-llama --systems "$order" \
      --overhead-requests 0 --throughput-secs 0 \
      --fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --out "$out/round-$round/$w"
    rm -f "$out/round-$round/$w"/*.log "$out/round-$round/$w"/backends-*.toml
  done
done
