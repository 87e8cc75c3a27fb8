#!/bin/bash
# run.sh WORKLOAD POLICY OUT: the servers' prefix caches reset, then one router (127.0.0.1:18200)
# in front of a running real vLLM fleet (target/vllm-fleet/fleet.json) with the decision and
# first-byte debug logs in OUT.log, and one `bench run` of WORKLOAD with
# scripts/vllm-workloads.sh's flags (requests in OUT/, its row in OUT.row).
# Usage (from the repository's root): run.sh multi-turn cost /tmp/mt-cost
w=$1; pol=$2; out=$3
exe=target/release/prefix-router
# shellcheck source=scripts/vllm-workloads.sh
. scripts/vllm-workloads.sh
urls=$(python3 -c "import json; print(' '.join(json.load(open('target/vllm-fleet/fleet.json'))['urls']))")
for u in $urls; do curl -s -X POST "$u/reset_prefix_cache" > /dev/null; done
$exe serve --listen 127.0.0.1:18200 --backend "${urls// /,}" --policy "$pol" \
  --log warn,prefix_router::decision=debug,prefix_router::ttft=debug > "$out.log" 2>&1 &
r=$!
sleep 5
# shellcheck disable=SC2046
$exe bench run --url http://127.0.0.1:18200 --workload "$w" $(args_for "$w") --model tiny-llama --out "$out" > "$out.row" 2>&1
kill $r; wait 2>/dev/null
