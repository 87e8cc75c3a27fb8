#!/bin/bash
# A/B of the replicas' rank under `prefix_load` on 8 sims: replica-stall-2026-12-07/sims.sh with
# POLICY=prefix_load — `prefix_load+replicas` through OLD (replicas order equal backends alike),
# then `prefix_load,prefix_load+replicas` through NEW (replica `rank` takes the `rank`-th of the
# equally loaded ones). WORKLOADS, RUN, SWAP=1 (NEW first) as there.
# Usage: OLD=EXE NEW=EXE OUT=DIR docs/bench/issue16/replica-rank-prefix-load-2026-12-07/sims.sh
POLICY=prefix_load exec bash "$(dirname "$0")/../replica-stall-2026-12-07/sims.sh"
