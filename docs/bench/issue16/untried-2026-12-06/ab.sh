#!/bin/bash
# `cost` before (OLD: 9a05428) and after (NEW) untried backends were judged by the fastest
# line seen; `prefix_load` through NEW beside them (scripts/sims-ab.sh: 8 sims, each workload
# once per binary, alternating). (with-fleet-line/: NEW was 3747301, whose lines were also held
# near the fleet's line; the old-* runs were the same binary's.) Data written beside this script.
here="$(dirname "$0")"
OUT=${OUT:-$here} exec "$here/../../../../scripts/sims-ab.sh"
