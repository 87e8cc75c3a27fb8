#!/bin/bash
# Issue 16 goals table on 8 sims, every system, every workload (README command).
cd /work/main
B=./target/release/prefix-router
SYS=prefix_load,cost,oracle,vllm-router,sglang-router,smg
OUT=/tmp/goals/out
python3 scripts/agent-trace.py /tmp/goals/agent.jsonl
common="--sim-servers 8 --systems $SYS --overhead-requests 0 --throughput-secs 0"
for w in shared-prefix multi-turn prefix-repetition bursty; do
  $B bench compare --workload $w --sim-args "--kv-blocks 3000" $common --out $OUT/$w > $OUT-$w.log 2>&1
done
$B bench compare --workload trace --trace /tmp/goals/agent.jsonl --sim-args "--kv-blocks 3000" $common --out $OUT/agent > $OUT-agent.log 2>&1
$B bench compare --workload mooncake --trace /tmp/goals/synthetic_trace.jsonl --requests 1000 --speedup 2 --sim-args "--kv-blocks 20000" $common --out $OUT/mooncake > $OUT-mooncake.log 2>&1
echo done > /tmp/goals/DONE
