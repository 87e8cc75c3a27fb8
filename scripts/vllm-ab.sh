#!/bin/bash
# A/B of two router binaries on a real vLLM fleet: `cost` through OLD, then `cost,prefix_load`
# through NEW, one `bench compare` each per workload (scripts/vllm-workloads.sh's flags); with
# SWAP=1, NEW's `cost` first and `cost,prefix_load` through OLD (to tell a change from the
# order). Needs a running fleet (`prefix-router bench vllm-fleet --vllm-servers 2 --work-dir
# target/vllm-fleet`, warmed by one discarded run). OUT: where the data go; WORKLOADS (default:
# shared-prefix prefix-repetition multi-turn); RUN=-2 ... for further rounds.
# Usage: OLD=EXE NEW=EXE OUT=DIR scripts/vllm-ab.sh   (from the repository's root)
set -u
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0"
# shellcheck source=scripts/vllm-workloads.sh
. "$(dirname "$0")/vllm-workloads.sh"
run() { # EXE NAME SYSTEMS WORKLOAD
  # shellcheck disable=SC2046,SC2086
  "$1" bench compare --workload $4 $(args_for $4) $f --systems $3 --out $OUT/$2-$4${RUN:-}
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
