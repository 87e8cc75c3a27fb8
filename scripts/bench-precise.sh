#!/usr/bin/env bash
# Precise mode (KV events) against the string index and the oracle, on 8 sims that publish
# vLLM's KV events and tokenize with the real-vLLM fleet's tokenizer (its random-letter words
# come to ~1.8 bytes a token, so caches and rates are scaled from the byte-token defaults).
# Usage: scripts/bench-precise.sh [OUT_DIR]   (default bench-results/precise; about 20 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/precise}"
cargo build --release --quiet
exe=target/release/prefix-router
python=$(bash scripts/vllm-venv.sh)
model=target/vllm-fleet/model
[ -s "$model/tokenizer.json" ] || "$python" scripts/vllm-model.py "$model" >/dev/null
events="--kv-events --tokenizer $model"
common=(--overhead-requests 0 --throughput-secs 0 --router-replicas 4)
mkdir -p "$out"

# Hit rate against the oracle, one router and four replicas without a shared store.
systems="prefix_load,prefix_load+events,prefix_load+replicas,prefix_load+events+replicas,oracle"
"$exe" bench compare --workload shared-prefix --qps 25 --requests 1500 "${common[@]}" \
  --sim-args "--kv-blocks 6600 $events" --systems "$systems" --out "$out/shared-prefix"
"$exe" bench compare --workload multi-turn --qps 2 --duration 60 "${common[@]}" \
  --sim-args "--kv-blocks 6600 $events" --systems "$systems" --out "$out/multi-turn"

# Cache pressure: each server's cache is a third of what the routers are told (as when the
# capacity estimate is wrong), so the string index routes to prefixes long evicted.
"$exe" bench compare --workload shared-prefix --qps 25 --requests 1500 "${common[@]}" \
  --sim-args "--kv-blocks 2200 $events" --assumed-cache-factor 3 \
  --systems "prefix_load,prefix_load+events,oracle" --out "$out/cache-pressure"
rm -f "$out"/*/*.log "$out"/*/*.toml
