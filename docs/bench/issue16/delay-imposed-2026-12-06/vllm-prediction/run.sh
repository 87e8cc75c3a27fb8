#!/bin/bash
# How right the predicted TTFT is on real vLLM, request by request: one fresh router per policy
# in front of a running 2-server fleet (target/vllm-fleet/fleet.json), the first-byte and
# decision logs in POLICY.log, one `bench run` of shared-prefix (scripts/vllm-workloads.sh's
# flags); then analyze.py. Usage: run.sh EXE URL0,URL1 [OUT]   (from the repository's root;
# the logs go to OUT, by default beside this script)
set -u
here="$(dirname "$0")"
out="${3:-$here}"
mkdir -p "$out"
. scripts/vllm-workloads.sh
for pol in prefix_load cost; do
  "$1" serve --listen 127.0.0.1:18300 --backend "$2" --policy $pol \
    --log warn,prefix_router::ttft=debug,prefix_router::decision=debug > "$out/$pol.log" 2>&1 &
  r=$!
  sleep 3
  # shellcheck disable=SC2046
  "$1" bench run --url http://127.0.0.1:18300 --workload shared-prefix $(args_for shared-prefix) --model tiny-llama > /dev/null 2>&1
  kill $r; wait $r 2>/dev/null
done
python3 "$here/analyze.py" "$out"/*.log
