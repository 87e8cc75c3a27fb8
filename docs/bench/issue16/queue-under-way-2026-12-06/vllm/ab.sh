#!/bin/bash
# The real-vLLM half of docs/bench/issue16/queue-under-way-2026-12-06: `cost` through the binary
# with the queue under way subtracted (NEW) and the binary before (OLD, 87c5274), alternating,
# on one 2-server fleet (`prefix-router bench vllm-fleet --vllm-servers 2 --work-dir
# target/vllm-fleet`, warmed by one discarded run), with scripts/bench-vllm.sh's workload flags.
# Run from the repository's root; data written here.
set -u
here="$(dirname "$0")"
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0"
# shellcheck source=scripts/vllm-workloads.sh
. "$here/../../../../../scripts/vllm-workloads.sh"
for w in ${WORKLOADS:-shared-prefix prefix-repetition multi-turn}; do
  # shellcheck disable=SC2046,SC2086
  "$OLD" bench compare --workload $w $(args_for $w) $f --systems cost --out $here/base-$w${RUN:-}
  # shellcheck disable=SC2046,SC2086
  "$NEW" bench compare --workload $w $(args_for $w) $f --systems cost --out $here/new-$w${RUN:-}
done
