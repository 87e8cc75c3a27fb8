#!/bin/bash
# The headline comparison on real vLLM (the CPU fleet: `prefix-router bench vllm-fleet
# --vllm-servers 2`, warmed by one discarded run; the peers from scripts/peers-venv.sh): the
# default policy, `prefix_load`, the oracle and the three peers on the fleet's four workloads
# (scripts/vllm-workloads.sh), every system in one `bench compare` per workload, ROUNDS rounds,
# the systems' order reversed every other round. Summarize with bench/rounds-summary.py OUT.
# Usage: bench/goals-vllm.sh [OUT] [ROUNDS]   (about 20 minutes a round; OUT defaults to
# bench-results/goals-vllm)
set -eu
cd "$(dirname "$0")/.."
out=${1:-bench-results/goals-vllm}
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
  done
done
