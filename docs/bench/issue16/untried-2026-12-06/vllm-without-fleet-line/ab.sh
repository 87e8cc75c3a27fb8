#!/bin/bash
# What was kept, on real vLLM: ../vllm/ab.sh with NEW the binary without the fleet's line
# (a build of 37c53e6's routing), data written here.
OUT="$(dirname "$0")" exec "$(dirname "$0")/../vllm/ab.sh"
