# The workloads scaled to a 2-server CPU vLLM fleet: `args_for WORKLOAD` prints their
# `bench compare` flags. Sourced by scripts/bench-vllm.sh and the benchmark scripts under docs/.
args_for() {
  case "$1" in
    shared-prefix) echo "--groups 16 --prompts-per-group 6 --system-len 400 --question-len 32 --output-len 16 --qps 1.5" ;;
    multi-turn) echo "--users 12 --turns 4 --system-len 300 --history-len 100 --question-len 32 --answer-len 16 --qps 1" ;;
    bursty) echo "--groups 16 --burst 4 --burst-spread-ms 5 --system-len 600 --question-len 32 --output-len 16 --qps 0.5" ;;
    prefix-repetition) echo "--prefix-len 400 --suffix-len 64 --num-prefixes 8 --output-len 16 --qps 1.5" ;;
    *) echo "unknown workload $1" >&2; exit 2 ;;
  esac
}

# calibrate_sims EXE WORK SERVERS PROBED REQUEST_DIR...: the sims as the CPU vLLM of
# scripts/vllm-model.py (its tokenizer in WORK/model, vLLM's block size, cache and batch, KV
# events as vLLM publishes them) at the speed of the fleet: step overhead and prefill rate fitted
# on the vLLM requests under REQUEST_DIRs that met an idle fleet (PROBED, the idle probe's
# `scripts/vllm-speed.py --sim-args URL`, gives the time between tokens); the fit's intercept
# holds the router and HTTP of those runs, so a short round-robin run of SERVERS sims at that
# speed tells what the sims add by themselves, and it comes off their step overhead. Sets
# `fitted` (before that correction), `speed` (after) and `sim_args` (the sims' flags).
calibrate_sims() {
  local exe=$1 work=$2 servers=$3 probed=$4
  shift 4
  fitted=$(python3 scripts/vllm-speed.py --from-requests "$probed" "$@")
  local sim_base="--model tiny-llama --tokenizer $work/model --kv-events --block-size 32 --kv-blocks 512 --max-model-len 8192 --max-num-batched-tokens 2048"
  rm -rf "$work/sim-calibration"
  # shellcheck disable=SC2046
  "$exe" bench compare --workload shared-prefix $(args_for shared-prefix) --model tiny-llama --systems round_robin \
    --overhead-requests 0 --throughput-secs 0 \
    --fleet sim --sim-servers "$servers" --sim-args "$sim_base $fitted" --out "$work/sim-calibration"
  speed=$(python3 scripts/vllm-speed.py --correct "$fitted" "$work/sim-calibration/requests")
  sim_args="$sim_base $speed"
}
