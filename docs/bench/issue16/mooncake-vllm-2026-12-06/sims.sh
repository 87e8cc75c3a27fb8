#!/bin/bash
# The same scaled conversation trace on 2 sims calibrated to the CPU fleet as
# scripts/bench-vllm.sh calibrates them: vLLM's tokenizer, block size and cache; step overhead
# and prefill rate fitted on this workload's own vLLM requests that met an idle fleet, less what
# the sims add by themselves; the time between tokens from the idle probe.
# Usage: docs/bench/issue16/mooncake-vllm-2026-12-06/sims.sh TRACE "PROBED_FLAGS" OUT [SYSTEMS]
#   PROBED_FLAGS: `python3 scripts/vllm-speed.py --sim-args URL` on a server of the fleet.
set -eu
trace=$(realpath "$1")
probed=$2
cd "$(dirname "$0")/../../../.."
out=$3
systems=${4:-prefix_load,cost,oracle,vllm-router,sglang-router,smg}
here=docs/bench/issue16/mooncake-vllm-2026-12-06
exe=target/release/prefix-router
work=target/vllm-fleet
# shellcheck source=scripts/vllm-workloads.sh
. scripts/vllm-workloads.sh
calibrate_sims "$exe" "$work" 2 "$probed" $here/conversation-*/requests
mkdir -p "$out"
{
  echo "sim speed (used): $speed"
  echo "fitted on the vLLM runs' idle requests: $fitted"
  echo "idle probe: $probed"
} | tee "$out/sim-speed.txt"
$exe bench compare --fleet sim --sim-servers 2 --sim-args "$sim_args" --model tiny-llama \
  --workload mooncake --trace "$trace" --mooncake-block-tokens 8 --speedup 12 --requests 2000 \
  --systems "$systems" --overhead-requests 0 --throughput-secs 0 --out "$out"
rm -f "$out"/*.log "$out"/backends-*.toml
