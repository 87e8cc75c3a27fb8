#!/bin/bash
# The real-vLLM half of docs/bench/issue16/cost-guard-2026-12-06: `cost` with the load guard (and
# prefix_load) from the new binary, `cost` without it from the binary before (77526f2), on one
# 2-server fleet (`prefix-router bench vllm-fleet --vllm-servers 2 --work-dir target/vllm-fleet`),
# with scripts/bench-vllm.sh's workload flags. NEW and OLD name the two builds' executables.
set -u
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0"
# shellcheck source=scripts/vllm-workloads.sh
. "$(dirname "$0")/../../../../../scripts/vllm-workloads.sh"
for w in multi-turn shared-prefix prefix-repetition; do
  # shellcheck disable=SC2046,SC2086
  "$NEW" bench compare --workload $w $(args_for $w) $f --systems cost,prefix_load --out guard-$w
  # shellcheck disable=SC2046,SC2086
  "$OLD" bench compare --workload $w $(args_for $w) $f --systems cost --out base-$w
done
# then prefix-repetition once more, OLD first, into base-/guard-prefix-repetition-2
