#!/usr/bin/env bash
# Runs every cargo-fuzz target for SECONDS each (default 60). Crashes land in
# fuzz/artifacts/<target>/; turn each into a regression test before fixing it.
# Needs cargo-fuzz (`cargo install cargo-fuzz`); on a stable toolchain RUSTC_BOOTSTRAP lets it
# use the sanitizer flags it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
for target in ${FUZZ_TARGETS:-request_string chunker index_json serve_json kv_events zmtp_peer bus_frame}; do
  echo "== $target ($secs s)"
  cargo fuzz run "$target" -- -max_total_time="$secs" -rss_limit_mb=4096 2>&1 | grep -E '^(#[0-9]+.*DONE|Done|==[0-9]+==|SUMMARY|thread .* panicked|artifact)' || true
  if ls "fuzz/artifacts/$target"/crash-* >/dev/null 2>&1; then
    echo "$target: CRASH, see fuzz/artifacts/$target" >&2
    exit 1
  fi
done
echo "all fuzz targets ran $secs s without a crash"
