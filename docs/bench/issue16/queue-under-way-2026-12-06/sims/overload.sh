#!/bin/bash
# The gateway queue's overload run on 4 sims (README "The gateway queue under overload"),
# `cost` and `cost+queue`, through the binary before (OLD) and after (NEW). From the root.
set -u
here="$(dirname "$0")"
for b in base new; do
  if [ $b = base ]; then e=$OLD; else e=$NEW; fi
  "$e" bench compare --workload overload --sim-servers 4 --random-count 1200 --input-len 1024 \
    --output-len 16 --qps 140 --systems cost,cost+queue \
    --queue-args "--max-queue-wait 60ms --max-queued 100000" --overhead-requests 0 \
    --throughput-secs 0 --out "$here/$b-overload"
done
