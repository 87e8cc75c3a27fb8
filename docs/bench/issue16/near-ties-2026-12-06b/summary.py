#!/usr/bin/env python3
"""Prints each workload's rows (hit | p99 | mean | imbalance) by variant and round from the
results.md files here, and each variant's mean TTFT over its rounds."""
import glob, os, re, statistics
here = os.path.dirname(os.path.abspath(__file__))
rows = {}
for path in sorted(glob.glob(os.path.join(here, "*", "results.md"))):
    name = os.path.basename(os.path.dirname(path))
    m = re.match(r"(.+)-(turn|lrc|held|hash)(-\d)?$", name)
    if not m:
        continue
    cells = [c.strip() for c in open(path).read().splitlines()[2].split("|")]
    hit, p99, mean, imb = cells[2], cells[5], cells[6], cells[10]
    rows.setdefault(m.group(1), {}).setdefault(m.group(2), []).append((hit, p99, float(mean), imb))
for w, variants in rows.items():
    for v, runs in variants.items():
        runs_s = "  ".join(f"{h}/{p}/{m:.1f}/{i}" for h, p, m, i in runs)
        print(f"{w:18} {v:5} mean of means {statistics.mean(r[2] for r in runs):6.1f}   (hit/p99/mean/imbalance) {runs_s}")
