#!/usr/bin/env python3
"""cost against prefix_load, four runs each per workload on one real vLLM fleet (`SYSTEMS=...
docs/bench/issue16/default-2026-12-06/vllm.sh DIR`): each system's runs (mean / p50 / p99 TTFT ms,
hit rate), the mean and median of its runs, and in how many of the adjacent pairs (runs 1-2,
3-4, 5-6, 7-8: the order alternates) cost read lower."""
import os, re, statistics, sys
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
for w in ["shared-prefix", "prefix-repetition", "multi-turn", "bursty"]:
    path = os.path.join(here, w, "results.md")
    if not os.path.exists(path):
        continue
    runs = []
    for line in open(path).read().splitlines()[2:]:
        c = [x.strip() for x in line.split("|")]
        if len(c) < 8:
            continue
        runs.append((c[1], float(c[2]), float(c[3]), float(c[5]), float(c[6])))
    print(f"## {w}")
    for system in ["prefix_load", "cost"]:
        mine = [r for r in runs if r[0] == system]
        if not mine:
            continue
        cells = "  ".join(f"{r[4]:.1f}/{r[2]:.1f}/{r[3]:.0f}/{r[1]:.3f}" for r in mine)
        means = [r[4] for r in mine]
        p50s = [r[2] for r in mine]
        print(f"{system:12} mean of means {statistics.mean(means):6.1f}  median of means "
              f"{statistics.median(means):6.1f}  mean p50 {statistics.mean(p50s):5.1f}   "
              f"(mean/p50/p99/hit) {cells}")
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs) - 1, 2)]
    lower = lambda k: sum(1 for a, b in pairs
                          if (a if a[0] == "cost" else b)[k] < (b if a[0] == "cost" else a)[k])
    print(f"cost lower in {lower(4)} of {len(pairs)} pairs by mean, {lower(2)} by p50, "
          f"{lower(3)} by p99")
