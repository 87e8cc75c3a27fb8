#!/bin/bash
# The real-vLLM half of docs/bench/issue16/untried-2026-12-06: `cost` through the binary before
# (OLD, 9a05428) and after (NEW) untried backends were judged by the fastest line, then
# `prefix_load` through NEW (scripts/vllm-ab.sh, which says what SWAP, RUN and WORKLOADS do;
# OUT defaults to here). Here NEW was 3747301 (lines also held near the fleet's line);
# ../vllm-without-fleet-line/ holds the runs with what was kept.
here="$(dirname "$0")"
OUT=${OUT:-$here} exec "$here/../../../../../scripts/vllm-ab.sh"
