#!/bin/bash
# prefix_load against cost (the new default) on a real vLLM fleet, twice each in one compare per
# workload (scripts/vllm-workloads.sh's flags), the two policies alternating.
# Needs a running fleet (`prefix-router bench vllm-fleet --vllm-servers 2 --work-dir
# target/vllm-fleet`, warmed by one discarded run).
# SYSTEMS overrides the systems' list (e.g. more rounds).
# Usage: [SYSTEMS=...] docs/bench/issue16/default-2026-12-06/vllm.sh OUT [WORKLOADS]   (from the repository's root)
set -u
out=$1
exe=target/release/prefix-router
# shellcheck source=scripts/vllm-workloads.sh
. scripts/vllm-workloads.sh
for w in ${2:-shared-prefix prefix-repetition multi-turn bursty}; do
  # shellcheck disable=SC2046
  $exe bench compare --workload $w $(args_for $w) --fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json \
    --model tiny-llama --overhead-requests 0 --throughput-secs 0 \
    --systems ${SYSTEMS:-prefix_load,cost,prefix_load,cost} --out "$out/$w"
  rm -f "$out/$w"/*.log "$out/$w"/backends-*.toml
done
