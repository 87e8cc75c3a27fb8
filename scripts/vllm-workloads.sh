# The workloads scaled to a 2-server CPU vLLM fleet: `args_for WORKLOAD` prints their
# `bench compare` flags. Sourced by scripts/bench-vllm.sh and the benchmark scripts under docs/.
args_for() {
  case "$1" in
    shared-prefix) echo "--groups 16 --prompts-per-group 6 --system-len 400 --question-len 32 --output-len 16 --qps 1.5" ;;
    multi-turn) echo "--users 12 --rounds 4 --system-len 300 --history-len 100 --question-len 32 --answer-len 16 --qps 1" ;;
    bursty) echo "--groups 16 --burst 4 --burst-spread-ms 5 --system-len 600 --question-len 32 --output-len 16 --qps 0.5" ;;
    prefix-repetition) echo "--prefix-len 400 --suffix-len 64 --num-prefixes 8 --output-len 16 --qps 1.5" ;;
    *) echo "unknown workload $1" >&2; exit 2 ;;
  esac
}
