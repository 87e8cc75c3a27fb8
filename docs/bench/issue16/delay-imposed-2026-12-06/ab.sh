#!/bin/bash
# `cost` before (OLD: 8475128) and after (NEW) it charged the delay a placement imposes on the
# requests waiting there; `prefix_load` through NEW beside them. 8 sims, each workload once per
# binary, alternating. Run from the repository's root (agent: target/agent.jsonl from
# scripts/agent-trace.py); data written beside this script, or under OUT.
set -u
here="$(dirname "$0")"
out=${OUT:-$here}
s='--sim-servers 8 --sim-args "--kv-blocks 3000" --overhead-requests 0 --throughput-secs 0'
for w in ${WORKLOADS:-prefix-repetition shared-prefix multi-turn bursty agent}; do
  wl="--workload $w"; [ "$w" = agent ] && wl="--workload trace --trace target/agent.jsonl"
  eval "\"$OLD\" bench compare $wl $s --systems cost --out $out/old-$w"
  eval "\"$NEW\" bench compare $wl $s --systems cost,prefix_load --out $out/new-$w"
done
