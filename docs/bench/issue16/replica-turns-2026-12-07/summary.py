#!/usr/bin/env python3
"""Prints, per workload, each run's hit | p99 | mean | imbalance for the binary before (old:
every replica's counter starts at 0) and after (new: a random start), from DIR/*/results.md
(DIR: sims, or vllm), and each binary's mean TTFT over its runs."""
import glob, os, re, statistics, sys
here = os.path.dirname(os.path.abspath(__file__))
sub = sys.argv[1] if len(sys.argv) > 1 else "sims"
rows = {}
for path in sorted(glob.glob(os.path.join(here, sub, "*", "results.md"))):
    m = re.match(r"(old|new)-(.+?)(-\d)?$", os.path.basename(os.path.dirname(path)))
    if not m:
        continue
    for line in open(path).read().splitlines()[2:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 11 or not cells[1].endswith("+replicas"):
            continue
        hit, p99, mean, imb = cells[2], cells[5], cells[6], cells[10]
        rows.setdefault(m.group(2), {}).setdefault(m.group(1), []).append((hit, p99, float(mean), imb))
for w, variants in rows.items():
    for v in ("old", "new"):
        runs = variants.get(v, [])
        if not runs:
            continue
        runs_s = "  ".join(f"{h}/{p}/{m:.1f}/{i}" for h, p, m, i in runs)
        print(f"{w:18} {v:4} mean of means {statistics.mean(r[2] for r in runs):6.1f}   (hit/p99/mean/imbalance) {runs_s}")
