#!/bin/bash
# Whole answers on real vLLM: `prefix_load` and `cost` through the binary before (OLD, b083087)
# and after (NEW, whole answers leave the prefill queue when their prefill is due), shared-prefix
# with scripts/bench-vllm.sh's flags and --no-stream, on one 2-server fleet
# (`prefix-router bench vllm-fleet --vllm-servers 2 --work-dir target/vllm-fleet`). From the root.
set -u
here="$(dirname "$0")"
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0 --no-stream"
# shellcheck source=scripts/vllm-workloads.sh
. "$here/../../../../../scripts/vllm-workloads.sh"
for w in ${WORKLOADS:-shared-prefix}; do
  # shellcheck disable=SC2046,SC2086
  "$OLD" bench compare --workload $w $(args_for $w) $f --systems prefix_load,cost --out $here/before-$w
  # shellcheck disable=SC2046,SC2086
  "$NEW" bench compare --workload $w $(args_for $w) $f --systems prefix_load,cost --out $here/after-$w
done
