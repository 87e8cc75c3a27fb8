#!/usr/bin/env bash
# Starts N real vLLM servers (vLLM's CPU build, a tiny Llama with random weights and a real
# tokenizer) on free loopback ports, prints their URLs and KV-event endpoints, and stops them
# on Ctrl-C. The first run installs vLLM into ~/.cache/prefix-router/vllm-venv (about 6 GB).
# Usage: scripts/vllm-fleet.sh [N] [more `bench vllm-fleet` flags]
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-2}"
shift || true
exec cargo run --release --quiet -- bench vllm-fleet --vllm-servers "$n" "$@"
