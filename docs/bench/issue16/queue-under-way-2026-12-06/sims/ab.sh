#!/bin/bash
# The sims half of docs/bench/issue16/queue-under-way-2026-12-06: `cost` through the binary with
# the queue under way subtracted (NEW) and the binary before (OLD, 87c5274), 8 sims, each
# workload once per binary, alternating. Run from the repository's root; data written here.
set -u
here="$(dirname "$0")"
s='--sim-servers 8 --sim-args "--kv-blocks 3000" --overhead-requests 0 --throughput-secs 0'
for w in ${WORKLOADS:-shared-prefix prefix-repetition multi-turn bursty}; do
  eval "\"$OLD\" bench compare --workload $w $s --systems cost --out $here/base-$w"
  eval "\"$NEW\" bench compare --workload $w $s --systems cost --out $here/new-$w"
done
