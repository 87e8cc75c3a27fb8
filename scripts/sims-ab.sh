#!/bin/bash
# A/B of two router binaries on 8 sims (`--kv-blocks 3000`): `cost` through OLD, then
# `cost,prefix_load` through NEW, one `bench compare` each per workload, alternating. OUT: where
# the data go (OUT/old-W, OUT/new-W); WORKLOADS (default: prefix-repetition shared-prefix
# multi-turn bursty agent; agent replays target/agent.jsonl from scripts/agent-trace.py).
# Usage: OLD=EXE NEW=EXE OUT=DIR scripts/sims-ab.sh   (from the repository's root)
set -u
s='--sim-servers 8 --sim-args "--kv-blocks 3000" --overhead-requests 0 --throughput-secs 0'
for w in ${WORKLOADS:-prefix-repetition shared-prefix multi-turn bursty agent}; do
  wl="--workload $w"; [ "$w" = agent ] && wl="--workload trace --trace target/agent.jsonl"
  eval "\"$OLD\" bench compare $wl $s --systems cost --out $OUT/old-$w"
  eval "\"$NEW\" bench compare $wl $s --systems cost,prefix_load --out $OUT/new-$w"
done
