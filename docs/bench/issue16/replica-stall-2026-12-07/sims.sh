#!/bin/bash
# A/B of the replicas' shared stall clock: `cost+replicas` (4 replicas on the replica bus,
# clients round robin over them) through OLD (a queue a peer sent is charged whole), then
# `cost,cost+replicas` through NEW (a queue is worked on from when it formed, whichever replica
# sent to it; one router beside them for reference), per workload, on 8 sims (`--kv-blocks
# 3000`). Needs a NATS server at 127.0.0.1:4222. OUT: where the data go (OUT/old-W, OUT/new-W);
# WORKLOADS (default: shared-prefix bursty prefix-repetition multi-turn); RUN=-2 ... for rounds;
# EXTRA: more flags for every run (the first-bytes A/B: its decision logs); POLICY: the policy
# of both (default cost); SWAP=1 runs NEW first.
# Usage: OLD=EXE NEW=EXE OUT=DIR docs/bench/issue16/replica-stall-2026-12-07/sims.sh
set -u
s='--sim-servers 8 --sim-args "--kv-blocks 3000" --overhead-requests 0 --throughput-secs 0'
s="$s --replica-bus nats://127.0.0.1:4222 ${EXTRA:-}"
for w in ${WORKLOADS:-shared-prefix bursty prefix-repetition multi-turn}; do
  p=${POLICY:-cost}
  old="\"$OLD\" bench compare --workload $w $s --systems $p+replicas --out $OUT/old-$w${RUN:-}"
  new="\"$NEW\" bench compare --workload $w $s --systems $p,$p+replicas --out $OUT/new-$w${RUN:-}"
  if [ -n "${SWAP:-}" ]; then eval "$new"; eval "$old"; else eval "$old"; eval "$new"; fi
done
