#!/bin/bash
# A/B of the decision counter's start across router replicas: `cost+replicas` (4 replicas on
# the replica bus, clients round robin over them) through OLD (every replica's counter starts
# at 0) and NEW (a random start), alternating per workload, on 8 sims (`--kv-blocks 3000`).
# Needs a NATS server at 127.0.0.1:4222. OUT: where the data go (OUT/old-W, OUT/new-W);
# WORKLOADS (default: bursty shared-prefix prefix-repetition multi-turn); RUN=-2 ... for rounds.
# Usage: OLD=EXE NEW=EXE OUT=DIR docs/bench/issue16/replica-turns-2026-12-07/sims.sh
# Summary: python3 docs/bench/issue16/replica-stall-2026-12-07/summary.py OUT
set -u
s='--sim-servers 8 --sim-args "--kv-blocks 3000" --overhead-requests 0 --throughput-secs 0'
s="$s --replica-bus nats://127.0.0.1:4222 --systems cost+replicas"
for w in ${WORKLOADS:-bursty shared-prefix prefix-repetition multi-turn}; do
  eval "\"$OLD\" bench compare --workload $w $s --out $OUT/old-$w${RUN:-}"
  eval "\"$NEW\" bench compare --workload $w $s --out $OUT/new-$w${RUN:-}"
done
