#!/usr/bin/env python3
"""Per workload and round of bench/goals-vllm.sh's output (DIR/round-N/W/results.md): each system's mean TTFT
ms (hit rate), then the mean over rounds, `cost` and `prefix_load` divided by the best peer's
(the lowest mean of vllm-router, sglang-router and smg) and by the oracle's."""
import glob, os, statistics, sys
d = sys.argv[1]
systems = ["cost", "prefix_load", "oracle", "vllm-router", "sglang-router", "smg"]
peers = systems[3:]
for w in ["shared-prefix", "multi-turn", "prefix-repetition", "bursty"]:
    means = {s: [] for s in systems}
    for results in sorted(glob.glob(os.path.join(d, "round-*", w, "results.md"))):
        cells = {}
        for line in open(results).read().splitlines()[2:]:
            c = [x.strip() for x in line.split("|")]
            if len(c) > 11 and c[1] in systems:
                cells[c[1]] = (float(c[6]), c[2], float(c[5]), c[10])
        for s, v in cells.items():
            means[s].append(v)
        print(f"{w:18} {os.path.basename(os.path.dirname(os.path.dirname(results)))}  "
              + "  ".join(f"{s} {v[0]:.1f} ({v[1]}, p99 {v[2]:.0f}, imb {v[3]})" for s, v in cells.items()))
    avg = {s: statistics.mean(x[0] for x in v) for s, v in means.items() if v}
    if not all(s in avg for s in systems):
        continue
    best = min(peers, key=lambda s: avg[s])
    print(f"{w:18} mean of rounds: " + "  ".join(f"{s} {v:.1f}" for s, v in avg.items())
          + f"  | best peer {best}: cost {avg['cost'] / avg[best]:.2f}x, prefix_load "
          f"{avg['prefix_load'] / avg[best]:.2f}x; ÷ oracle {avg['cost'] / avg['oracle']:.2f} / "
          f"{avg['prefix_load'] / avg['oracle']:.2f}")
