#!/bin/bash
# Bursts that overlap on real vLLM: bursty with a burst every ~0.5 s (--qps 2, 32 bursts of 4)
# instead of every 2 s, where the delay term has requests waiting to act on. `cost` through OLD
# then NEW, then NEW then OLD (RUN=-2), each with `prefix_load` through the second binary.
# Needs a running 2-server fleet (target/vllm-fleet/fleet.json), warmed. Usage: OLD=EXE NEW=EXE run.sh
set -u
here="$(dirname "$0")"
f="--fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json --model tiny-llama --overhead-requests 0 --throughput-secs 0"
w="--workload bursty --groups 32 --burst 4 --burst-spread-ms 5 --system-len 600 --question-len 32 --output-len 16 --qps 2"
# shellcheck disable=SC2086
{
  "$OLD" bench compare $w $f --systems cost --out "$here/old"
  "$NEW" bench compare $w $f --systems cost,prefix_load --out "$here/new"
  "$NEW" bench compare $w $f --systems cost --out "$here/new-2"
  "$OLD" bench compare $w $f --systems cost,prefix_load --out "$here/old-2"
}
