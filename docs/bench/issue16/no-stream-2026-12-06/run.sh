#!/bin/bash
# `prefix_load` and `cost` on whole (non-streamed) answers, 8 sims: what `cost` does when no
# first byte comes before the answer is done. From the repository's root; EXE (default the
# release build) and OUT (default after/, here) name the binary and the results' directory;
# before/ is the binary of b083087, after/ the one whose whole answers leave the prefill queue
# when their prefill is predicted done.
set -u
here="$(dirname "$0")"
for w in shared-prefix multi-turn prefix-repetition; do
  "${EXE:-target/release/prefix-router}" bench compare --workload $w --no-stream --sim-servers 8 \
    --sim-args "--kv-blocks 3000" --systems prefix_load,cost --overhead-requests 0 \
    --throughput-secs 0 --out "$here/${OUT:-after}/$w"
done
