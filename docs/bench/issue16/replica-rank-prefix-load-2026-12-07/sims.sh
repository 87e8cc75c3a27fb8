#!/bin/bash
# A/B of the replicas' rank under `prefix_load`: `prefix_load+replicas` (4 replicas on the
# replica bus, clients round robin over them) through OLD (replicas order equal backends alike),
# then `prefix_load,prefix_load+replicas` through NEW (replica `rank` takes the `rank`-th of the
# equally loaded ones; one router beside them for reference), per workload, on 8 sims
# (`--kv-blocks 3000`). Needs a NATS server at 127.0.0.1:4222. OUT: where the data go
# (OUT/old-W, OUT/new-W); WORKLOADS (default: bursty shared-prefix prefix-repetition
# multi-turn); RUN=-2 ... for rounds; SWAP=1 runs NEW first.
# Usage: OLD=EXE NEW=EXE OUT=DIR docs/bench/issue16/replica-rank-prefix-load-2026-12-07/sims.sh
set -u
s='--sim-servers 8 --sim-args "--kv-blocks 3000" --overhead-requests 0 --throughput-secs 0'
s="$s --replica-bus nats://127.0.0.1:4222"
for w in ${WORKLOADS:-bursty shared-prefix prefix-repetition multi-turn}; do
  old="\"$OLD\" bench compare --workload $w $s --systems prefix_load+replicas --out $OUT/old-$w${RUN:-}"
  new="\"$NEW\" bench compare --workload $w $s --systems prefix_load,prefix_load+replicas --out $OUT/new-$w${RUN:-}"
  if [ -n "${SWAP:-}" ]; then eval "$new"; eval "$old"; else eval "$old"; eval "$new"; fi
done
