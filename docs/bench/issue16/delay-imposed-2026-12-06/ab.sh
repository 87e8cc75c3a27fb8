#!/bin/bash
# `cost` before (OLD: 8475128) and after (NEW) it charged the delay a placement imposes on the
# requests waiting there; `prefix_load` through NEW beside them (scripts/sims-ab.sh: 8 sims,
# each workload once per binary, alternating). Data written beside this script, or under OUT.
here="$(dirname "$0")"
OUT=${OUT:-$here} exec "$here/../../../../scripts/sims-ab.sh"
