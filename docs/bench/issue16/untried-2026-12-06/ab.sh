#!/bin/bash
# `cost` before (OLD: 9a05428) and after (NEW) untried backends were judged by the fastest
# line seen; `prefix_load` through NEW beside them. (with-fleet-line/: NEW was 3747301, whose
# lines were also held near the fleet's line; the old-* runs were the same binary's.) 8 sims,
# each workload once per binary, alternating. Run from the repository's root (agent:
# target/agent.jsonl from scripts/agent-trace.py); data written beside this script.
set -u
here="$(dirname "$0")"
s='--sim-servers 8 --sim-args "--kv-blocks 3000" --overhead-requests 0 --throughput-secs 0'
for w in ${WORKLOADS:-prefix-repetition shared-prefix multi-turn bursty agent}; do
  wl="--workload $w"; [ "$w" = agent ] && wl="--workload trace --trace target/agent.jsonl"
  eval "\"$OLD\" bench compare $wl $s --systems cost --out $here/old-$w"
  eval "\"$NEW\" bench compare $wl $s --systems cost,prefix_load --out $here/new-$w"
done
