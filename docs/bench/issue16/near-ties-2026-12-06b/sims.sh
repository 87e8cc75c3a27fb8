#!/bin/bash
# cost's near-ties when some backend holds the prompt (best match > 0), variants switched by
# PR_NEAR in a temporary build (the switch is not committed), 8 sims, `--systems cost`:
# `turn` (PR_NEAR unset: in turn over the cost/load order, as committed), `lrc` (the near-tie
# this router chose longest ago; the turn among never-chosen), `held` (only the near-ties holding
# the longest match, in turn among them).
# Usage (from the repository's root, with such a build in target/release):
#   VARIANTS="turn lrc held" RUN=-2 OUT=DIR sims.sh
cd "$(dirname "$0")/../../../.."
exe=target/release/prefix-router
common="--sim-servers 8 --systems cost --overhead-requests 0 --throughput-secs 0"
for w in prefix-repetition shared-prefix multi-turn bursty agent; do
  wl="--workload $w"; [ $w = agent ] && wl="--workload trace --trace target/agent.jsonl"
  for v in ${VARIANTS:-turn lrc held}; do
    PR_NEAR=$v $exe bench compare $wl --sim-args "--kv-blocks 3000" $common --out ${OUT:-/tmp/near}/$w-$v${RUN:-} > /dev/null 2>&1
    echo "$w $v$RUN $(sed -n 3p ${OUT:-/tmp/near}/$w-$v${RUN:-}/results.md | cut -d'|' -f3,6,7,11)"
  done
done
