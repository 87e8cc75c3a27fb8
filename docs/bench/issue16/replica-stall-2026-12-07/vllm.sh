#!/bin/bash
# The same A/B on a real vLLM fleet: per workload (scripts/vllm-workloads.sh's flags),
# `cost+replicas` through OLD, then `cost,cost+replicas` through NEW (4 replicas on the replica
# bus at 127.0.0.1:4222). Needs a running fleet (`prefix-router bench vllm-fleet --vllm-servers
# 2 --work-dir target/vllm-fleet`, warmed by one discarded run). OUT: where the data go;
# WORKLOADS (default: shared-prefix prefix-repetition multi-turn); RUN=-2 ... for rounds;
# EXTRA: more flags for every run (the first-bytes A/B: its decision logs).
# Usage: OLD=EXE NEW=EXE OUT=DIR docs/bench/issue16/replica-stall-2026-12-07/vllm.sh
set -u
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0"
f="$f --replica-bus nats://127.0.0.1:4222"
read -r -a extra <<< "${EXTRA:-}"
# shellcheck source=scripts/vllm-workloads.sh
. scripts/vllm-workloads.sh
for w in ${WORKLOADS:-shared-prefix prefix-repetition multi-turn}; do
  # shellcheck disable=SC2046,SC2086
  "$OLD" bench compare --workload $w $(args_for $w) $f --systems cost+replicas --out $OUT/old-$w${RUN:-} "${extra[@]}"
  # shellcheck disable=SC2046,SC2086
  "$NEW" bench compare --workload $w $(args_for $w) $f --systems cost,cost+replicas --out $OUT/new-$w${RUN:-} "${extra[@]}"
done
