#!/usr/bin/env bash
# Real vLLM against the simulator calibrated to it, side by side, on workloads scaled to a CPU
# fleet: every system on a real fleet (routers, the three PyPI peers, the oracle following the
# servers' KV events), then the same on sims with vLLM's tokenizer, block size, cache size and
# measured speed; then the fidelity table (hit rates and TTFT ordering, sim vs vLLM).
# Usage: scripts/bench-vllm.sh [OUT_DIR]   (default bench-results/vllm; about 50 minutes)
#   VLLM_SERVERS (default 2), WORKLOADS (default "shared-prefix multi-turn prefix-repetition")
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/vllm}"
servers="${VLLM_SERVERS:-2}"
workloads="${WORKLOADS:-shared-prefix multi-turn prefix-repetition}"
systems="round_robin,least_loaded,prefix_load,prefix_load+events,cost,oracle,sglang-router,smg,vllm-router"
cargo build --release --quiet
exe=target/release/prefix-router
work=target/vllm-fleet
mkdir -p "$work" "$out"
rm -f "$work/fleet.json"
"$exe" bench vllm-fleet --vllm-servers "$servers" --work-dir "$work" > "$work/fleet.log" 2>&1 &
fleet=$!
trap 'kill -INT "$fleet" 2>/dev/null; wait "$fleet" 2>/dev/null || true' EXIT
until [ -s "$work/fleet.json" ]; do
  kill -0 "$fleet" 2>/dev/null || { echo "the vLLM fleet did not start; see $work/fleet.log" >&2; exit 1; }
  sleep 2
done

# shellcheck source=scripts/vllm-workloads.sh
. scripts/vllm-workloads.sh

# Every system on the real fleet first, each workload in turn.
for w in $workloads; do
  # shellcheck disable=SC2046
  "$exe" bench compare --workload "$w" $(args_for "$w") --model tiny-llama --systems "$systems" \
    --overhead-requests 0 --throughput-secs 0 \
    --fleet vllm --vllm-fleet-file "$work/fleet.json" --out "$out/$w/vllm"
done

# Then the simulator as the CPU vLLM of scripts/vllm-model.py, at the speed measured here
# (machines differ threefold; see calibrate_sims in scripts/vllm-workloads.sh), the idle probe's
# fit kept beside it for comparison.
url0=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["urls"][0])' "$work/fleet.json")
probed=$(python3 scripts/vllm-speed.py --sim-args "$url0")
request_dirs=()
for w in $workloads; do request_dirs+=("$out/$w/vllm/requests"); done
calibrate_sims "$exe" "$work" "$servers" "$probed" "${request_dirs[@]}"
{
  echo "sim speed (the benchmark's requests that met an idle fleet, less the sims' own latency; used): $speed"
  echo "sim speed (the same before that correction): $fitted"
  echo "sim speed (one request at a time on $url0, for comparison): $probed"
} | tee "$out/sim-speed.txt"
for w in $workloads; do
  # shellcheck disable=SC2046
  "$exe" bench compare --workload "$w" $(args_for "$w") --model tiny-llama --systems "$systems" \
    --overhead-requests 0 --throughput-secs 0 \
    --fleet sim --sim-servers "$servers" --sim-args "$sim_args" --out "$out/$w/sim"
  rm -f "$out/$w"/*/*.log "$out/$w"/*/backends-*.toml
done
python3 scripts/fidelity.py "$out" | tee "$out/fidelity.md"
