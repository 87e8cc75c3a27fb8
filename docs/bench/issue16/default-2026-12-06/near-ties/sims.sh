#!/bin/bash
# cost's near-ties, variants switched by PR_NEAR in temporary builds (not committed), 8 sims,
# one compare per variant: `turn` (PR_NEAR unset: in turn over the load order, as committed
# before), `load` (every near-tie by the load order: pr_near_load.patch), `fixed` (in turn over
# the candidates' own order: sort the near-ties by position before rotating), `first` (a prompt
# no backend holds by the load order, the rest in turn: pr_near_first.patch, committed since).
# Usage (from the repository's root, with such a build in target/release):
#   VARIANTS="turn first" RUN=-2 OUT=DIR sims.sh
cd "$(dirname "$0")/../../../../.."
exe=target/release/prefix-router
common="--sim-servers 8 --systems cost --overhead-requests 0 --throughput-secs 0"
for w in prefix-repetition shared-prefix multi-turn bursty agent; do
  wl="--workload $w"; [ $w = agent ] && wl="--workload trace --trace target/agent.jsonl"
  for v in ${VARIANTS:-turn load}; do
    PR_NEAR=$v $exe bench compare $wl --sim-args "--kv-blocks 3000" $common --out ${OUT:-/tmp/near}/$w-$v${RUN:-} > /dev/null 2>&1
    echo "$w $v$RUN $(sed -n 3p ${OUT:-/tmp/near}/$w-$v${RUN:-}/results.md | cut -d'|' -f3,6,7,11)"
  done
done
