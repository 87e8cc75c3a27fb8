#!/bin/bash
# Near-ties in `cost` taken by load instead of in turn (a temporary build, EXE, read PR_TIE:
# 0 = in turn as committed, 1 = weighted random by 1 / (1 + requests in flight) among all
# near-ties, 2 = the same among the near-ties holding the longest match, 3 = those holding the
# longest match first, by least in flight, deterministic: run as MODES=3 WORKLOADS="prefix-repetition
# shared-prefix"), 8 sims. From the root.
set -u
here="$(dirname "$0")"
s='--sim-servers 8 --sim-args "--kv-blocks 3000" --overhead-requests 0 --throughput-secs 0 --systems cost'
for w in ${WORKLOADS:-prefix-repetition shared-prefix multi-turn bursty agent}; do
  extra="--workload $w"; [ "$w" = agent ] && extra="--workload trace --trace target/agent.jsonl"
  for m in ${MODES:-0 1 2}; do
    eval "PR_TIE=$m \"$EXE\" bench compare $extra $s --out $here/mode$m-$w"
  done
done
