#!/bin/bash
# ab.sh with the order swapped, to tell the change from the order on a fleet whose later runs
# of a workload come out slower: per workload NEW's `cost` first, then OLD's `cost`, then
# `prefix_load` (through OLD). Same fleet and flags as ab.sh; outputs named as ab.sh's.
set -u
here="$(dirname "$0")"
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0"
# shellcheck source=scripts/vllm-workloads.sh
. "$here/../../../../../scripts/vllm-workloads.sh"
for w in ${WORKLOADS:-shared-prefix prefix-repetition multi-turn}; do
  # shellcheck disable=SC2046,SC2086
  "$NEW" bench compare --workload $w $(args_for $w) $f --systems cost --out $here/new-$w${RUN:-}
  # shellcheck disable=SC2046,SC2086
  "$OLD" bench compare --workload $w $(args_for $w) $f --systems cost,prefix_load --out $here/old-$w${RUN:-}
done
