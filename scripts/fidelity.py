"""The fidelity table: per workload and system, hit rate and mean TTFT on real vLLM and on the
simulator calibrated to it (scripts/bench-vllm.sh writes OUT/<workload>/{vllm,sim}/results.json),
and the median TTFT of the requests that met an idle fleet and of those that overlapped another
(from the runs' requests/*.jsonl): the first say whether the sims' speed is right, the second
whether what concurrent work costs is.

Usage: python3 scripts/fidelity.py OUT
"""

import json
import os
import statistics
import sys

from recorded_requests import load as load_requests, split_by_overlap


def load(path):
    with open(path) as f:
        results = json.load(f)
    # {"meta", "systems"}: each system with the figures of its median round.
    systems = results["systems"] if isinstance(results, dict) else results
    return {r["name"]: r for r in systems if not r.get("skipped")}


def rank(results):
    names = sorted(results, key=lambda n: results[n]["ttft_mean_ms"])
    return {n: i + 1 for i, n in enumerate(names)}


def idle_and_overlapped_ms(run_dir, system):
    """Median TTFT (ms) of the requests that met an idle fleet and of the others, as text."""
    path = os.path.join(run_dir, "requests", f"{system}.jsonl")
    if not os.path.exists(path):
        return "–", "–"
    return tuple(
        f"{statistics.median(r['ttft'] for r in rows) * 1000:.1f}" if rows else "–"
        for rows in split_by_overlap(load_requests(path))
    )


def main(out):
    print(
        "| workload | system | hit rate vLLM | hit rate sim | difference | TTFT mean vLLM ms | TTFT mean sim ms "
        "| rank vLLM | rank sim | idle fleet p50 vLLM / sim ms | overlapped p50 vLLM / sim ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    same_order = []
    for workload in sorted(os.listdir(out)):
        real_path = os.path.join(out, workload, "vllm", "results.json")
        sim_path = os.path.join(out, workload, "sim", "results.json")
        if not (os.path.exists(real_path) and os.path.exists(sim_path)):
            continue
        real, sim = load(real_path), load(sim_path)
        common = [n for n in real if n in sim]
        real_rank = rank({n: real[n] for n in common})
        sim_rank = rank({n: sim[n] for n in common})
        for n in common:
            diff = sim[n]["hit_rate"] - real[n]["hit_rate"]
            worst = max(worst, abs(diff))
            real_idle, real_overlapped = idle_and_overlapped_ms(os.path.dirname(real_path), n)
            sim_idle, sim_overlapped = idle_and_overlapped_ms(os.path.dirname(sim_path), n)
            print(
                f"| {workload} | {n} | {real[n]['hit_rate']:.3f} | {sim[n]['hit_rate']:.3f} | {diff:+.3f} "
                f"| {real[n]['ttft_mean_ms']:.1f} | {sim[n]['ttft_mean_ms']:.1f} | {real_rank[n]} | {sim_rank[n]} "
                f"| {real_idle} / {sim_idle} | {real_overlapped} / {sim_overlapped} |"
            )
        same_order.append((workload, all(real_rank[n] == sim_rank[n] for n in common)))
    print()
    print(f"Largest hit-rate difference: {worst:.3f} (goal: within 0.030).")
    for workload, same in same_order:
        print(f"{workload}: systems {'in the same order' if same else 'in a different order'} by mean TTFT.")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-results/vllm")
