#!/bin/bash
# decisions.sh EXE WORKLOAD OUT: 8 sims (--kv-blocks 3000), one router (POLICY, default cost) on
# 127.0.0.1:18200, one `bench run` of WORKLOAD (agent: the agent trace in /tmp/ab/agent.jsonl);
# writes the results row and the router's routing decisions by reason to OUT.
exe=$1; w=$2; out=$3
$exe sim --servers 8 --listen 127.0.0.1:18100 --kv-blocks 3000 > /dev/null 2>&1 &
sim=$!
sleep 2
b=$(for i in 0 1 2 3 4 5 6 7; do printf "http://127.0.0.1:181%02d," $i; done); b=${b%,}
$exe serve --listen 127.0.0.1:18200 --backend $b --policy ${POLICY:-cost} --log warn > /dev/null 2>&1 &
r=$!
sleep 3
s=$(for i in 0 1 2 3 4 5 6 7; do printf -- "--sim-url http://127.0.0.1:181%02d " $i; done)
extra=""; [ "$w" = agent ] && { w=trace; extra="--trace /tmp/ab/agent.jsonl"; }
$exe bench run --url http://127.0.0.1:18200 --workload $w $extra $s 2>/dev/null | grep "18200" > $out
curl -s 127.0.0.1:18200/metrics | grep 'routing_decisions_total{' | sed 's/.*reason="\([a-z_]*\)".* / \1 /' | tr '\n' ' ' >> $out
kill $r $sim; wait 2>/dev/null
