#!/bin/bash
# run.sh EXE WORKLOAD POLICY OUT: 8 sims (--kv-blocks 3000), one router (127.0.0.1:18200) with
# the decision and first-byte debug logs in OUT.log, one `bench run` of WORKLOAD; its row and the
# decisions by reason in OUT.row.
exe=$1; w=$2; pol=$3; out=$4
$exe sim --servers 8 --listen 127.0.0.1:18100 --kv-blocks 3000 > /dev/null 2>&1 &
sim=$!
sleep 2
b=$(for i in 0 1 2 3 4 5 6 7; do printf "http://127.0.0.1:181%02d," $i; done); b=${b%,}
$exe serve --listen 127.0.0.1:18200 --backend $b --policy $pol --log warn,prefix_router::decision=debug,prefix_router::ttft=debug > $out.log 2>&1 &
r=$!
sleep 3
s=$(for i in 0 1 2 3 4 5 6 7; do printf -- "--sim-url http://127.0.0.1:181%02d " $i; done)
$exe bench run --url http://127.0.0.1:18200 --workload $w $s 2>/dev/null | grep "18200" > $out.row
curl -s 127.0.0.1:18200/metrics | grep 'routing_decisions_total{' | sed 's/.*reason="\([a-z_]*\)".* / \1 /' | tr '\n' ' ' >> $out.row
kill $r $sim; wait 2>/dev/null
