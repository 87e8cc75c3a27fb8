#!/bin/bash
# The same A/B on a real vLLM fleet: per workload (scripts/vllm-workloads.sh's flags),
# `prefix_load+replicas` (4 replicas on the replica bus at 127.0.0.1:4222) through OLD and NEW,
# nothing else in the runs; SWAP=1 runs NEW first (this fleet drifts: alternate the order over
# rounds). Needs a running fleet (`prefix-router bench vllm-fleet --vllm-servers 2 --work-dir
# target/vllm-fleet`, warmed by one discarded run). OUT: where the data go; WORKLOADS (default:
# bursty); RUN=-2 ... for rounds.
# Usage: OLD=EXE NEW=EXE OUT=DIR docs/bench/issue16/replica-rank-prefix-load-2026-12-07/vllm.sh
set -u
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0"
f="$f --replica-bus nats://127.0.0.1:4222 --systems prefix_load+replicas"
# shellcheck source=scripts/vllm-workloads.sh
. scripts/vllm-workloads.sh
for w in ${WORKLOADS:-bursty}; do
  # shellcheck disable=SC2046,SC2086
  old() { "$OLD" bench compare --workload $w $(args_for $w) $f --out $OUT/old-$w${RUN:-}; }
  # shellcheck disable=SC2046,SC2086
  new() { "$NEW" bench compare --workload $w $(args_for $w) $f --out $OUT/new-$w${RUN:-}; }
  if [ -n "${SWAP:-}" ]; then new; old; else old; new; fi
done
