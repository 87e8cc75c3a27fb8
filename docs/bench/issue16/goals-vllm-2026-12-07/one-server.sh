#!/bin/bash
# Does this 2-server CPU fleet reward using one server? Per workload, `cost` on server 0 alone
# (a fleet file with its URL only) against `cost,smg` on both servers, the order alternated over
# two rounds. Needs the running fleet of run.sh. OUT/{one,two}-W-N: the runs.
# Usage: docs/bench/issue16/goals-vllm-2026-12-07/one-server.sh OUT
set -eu
out=$1
exe=target/release/prefix-router
python3 -c 'import json; f=json.load(open("target/vllm-fleet/fleet.json")); [f.__setitem__(k, f[k][:1]) for k in ("urls","kv_events","kv_replay")]; json.dump(f, open("target/vllm-fleet/one-server.json","w"))'
# shellcheck source=scripts/vllm-workloads.sh
. scripts/vllm-workloads.sh
for w in shared-prefix bursty; do
  one() { "$exe" bench compare --workload "$w" $(args_for "$w") --model tiny-llama --systems cost --overhead-requests 0 --throughput-secs 0 --fleet vllm --vllm-fleet-file target/vllm-fleet/one-server.json --out "$out/one-$w-$1"; }
  two() { "$exe" bench compare --workload "$w" $(args_for "$w") --model tiny-llama --systems cost,smg --overhead-requests 0 --throughput-secs 0 --fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --out "$out/two-$w-$1"; }
  one 1; two 1; two 2; one 2
  rm -f "$out"/*-"$w"-*/*.log "$out"/*-"$w"-*/backends-*.toml
done
