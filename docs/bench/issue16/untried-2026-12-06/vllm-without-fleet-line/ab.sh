#!/bin/bash
# docs/bench/issue16/untried-2026-12-06 on real vLLM, what was kept: `cost` through the binary
# before (OLD, 9a05428) and after (NEW: untried backends judged by the fastest line seen, without
# the fleet's line); `prefix_load` through NEW after them. One 2-server fleet (`prefix-router
# bench vllm-fleet --vllm-servers 2 --work-dir target/vllm-fleet`, warmed by one discarded
# run), scripts/bench-vllm.sh's workload flags; RUN=-2 ... for further rounds. Run from the
# repository's root; data written here.
set -u
here="$(dirname "$0")"
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0"
# shellcheck source=scripts/vllm-workloads.sh
. "$here/../../../../../scripts/vllm-workloads.sh"
for w in ${WORKLOADS:-shared-prefix prefix-repetition multi-turn}; do
  # shellcheck disable=SC2046,SC2086
  "$OLD" bench compare --workload $w $(args_for $w) $f --systems cost --out $here/old-$w${RUN:-}
  # shellcheck disable=SC2046,SC2086
  "$NEW" bench compare --workload $w $(args_for $w) $f --systems cost,prefix_load --out $here/new-$w${RUN:-}
done
