#!/bin/bash
# The real-vLLM half of docs/bench/issue16/untried-2026-12-06: `cost` through the binary before
# (OLD, 9a05428) and after (NEW) untried backends were judged by the fastest line, then
# `prefix_load` through NEW; with SWAP=1, NEW's `cost` first and `cost,prefix_load` through OLD
# (to tell the change from the order). One 2-server fleet (`prefix-router bench vllm-fleet
# --vllm-servers 2 --work-dir target/vllm-fleet`, warmed by one discarded run),
# scripts/bench-vllm.sh's workload flags; RUN=-2 ... for further rounds; OUT (default: here)
# for the data. Here NEW was 3747301 (lines also held near the fleet's line);
# ../vllm-without-fleet-line/ holds the runs with what was kept.
set -u
here="$(dirname "$0")"
out=${OUT:-$here}
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0"
# shellcheck source=scripts/vllm-workloads.sh
. "$here/../../../../../scripts/vllm-workloads.sh"
run() { # EXE NAME SYSTEMS WORKLOAD
  # shellcheck disable=SC2046,SC2086
  "$1" bench compare --workload $4 $(args_for $4) $f --systems $3 --out $out/$2-$4${RUN:-}
}
for w in ${WORKLOADS:-shared-prefix prefix-repetition multi-turn}; do
  if [ "${SWAP:-0}" = 1 ]; then
    run "$NEW" new cost $w
    run "$OLD" old cost,prefix_load $w
  else
    run "$OLD" old cost $w
    run "$NEW" new cost,prefix_load $w
  fi
done
