#!/usr/bin/env python3
"""Prints, per workload, `prefix_load+replicas` through the binary before (old-*) and after
(new-*) the rank, and one `prefix_load` router from the new runs: hit rate / mean TTFT ms /
p99 TTFT ms / imbalance per round, and the mean of the rounds' means. DIR: a folder of
old-W[-N] / new-W[-N] runs (default: `sims` beside this script)."""
import glob, os, re, statistics, sys
here = os.path.dirname(os.path.abspath(__file__))
sub = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "sims")
rows = {}
for run in sorted(glob.glob(os.path.join(sub, "*-*"))):
    m = re.match(r"(old|new)-(.+?)(-\d)?$", os.path.basename(run))
    results = os.path.join(run, "results.md")
    if not m or not os.path.exists(results):
        continue
    for line in open(results).read().splitlines()[2:]:
        c = [x.strip() for x in line.split("|")]
        if len(c) > 11 and c[1] in ("prefix_load", "prefix_load+replicas"):
            rows.setdefault(m.group(2), {}).setdefault(f"{m.group(1)} {c[1]}", []).append(
                (c[2], float(c[6]), float(c[5]), c[10]))
for w, lines in sorted(rows.items()):
    for label in ("old prefix_load+replicas", "new prefix_load+replicas", "new prefix_load"):
        runs = lines.get(label)
        if runs:
            print(f"{w:18} {label:25} mean {statistics.mean(r[1] for r in runs):6.1f}  "
                  "(hit/mean/p99/imbalance) "
                  + "  ".join(f"{r[0]}/{r[1]:.1f}/{r[2]:.1f}/{r[3]}" for r in runs))
