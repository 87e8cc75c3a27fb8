#!/bin/bash
# Does preloading tcmalloc and Intel's OpenMP (vLLM's CPU guide) steady the CPU fleet? Starts a
# 2-server fleet with PRELOAD (empty: none) in LD_PRELOAD, warms it with one discarded run, then
# runs `cost,smg` on shared-prefix and bursty (scripts/vllm-workloads.sh's flags) into OUT, and
# stops the fleet. Needs Debian's libgoogle-perftools4 for tcmalloc.
# Usage: PRELOAD="/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$HOME/.cache/prefix-router/vllm-venv/lib/libiomp5.so" \
#   docs/bench/issue16/vllm-preload-2026-12-07/run.sh OUT
set -eu
out=$1
exe=target/release/prefix-router
rm -f target/vllm-fleet/fleet.json
LD_PRELOAD="${PRELOAD:-}" "$exe" bench vllm-fleet --vllm-servers 2 --work-dir target/vllm-fleet > "$out.fleet.log" 2>&1 &
fleet=$!
trap 'kill -INT "$fleet" 2>/dev/null; wait "$fleet" 2>/dev/null || true' EXIT
until [ -s target/vllm-fleet/fleet.json ]; do sleep 2; done
# shellcheck source=scripts/vllm-workloads.sh
. scripts/vllm-workloads.sh
f="--model tiny-llama --overhead-requests 0 --throughput-secs 0 --fleet vllm --vllm-fleet-file target/vllm-fleet/fleet.json"
# shellcheck disable=SC2046,SC2086
"$exe" bench compare --workload shared-prefix $(args_for shared-prefix) $f --systems cost --out "$out/warm" > /dev/null 2>&1
for w in shared-prefix bursty; do
  # shellcheck disable=SC2046,SC2086
  "$exe" bench compare --workload $w $(args_for $w) $f --systems cost,smg --out "$out/$w"
  rm -f "$out/$w"/*.log "$out/$w"/backends-*.toml
done
rm -rf "$out/warm"
