#!/usr/bin/env python3
"""Prints, per workload and round, hit rate / TTFT p99 / mean / imbalance of `cost+replicas`
through the binary before (old-*) and after (new-*), and of one `cost` router where the new run
has it, from DIR/*/results.md, and each line's mean TTFT over the rounds. DIR: `sims` or `vllm`
beside this script, or any folder of old-*/new-* runs (the random-start A/B:
docs/bench/issue16/replica-turns-2026-12-07/sims)."""
import glob, os, re, statistics, sys
here = os.path.dirname(os.path.abspath(__file__))
sub = sys.argv[1] if len(sys.argv) > 1 else "sims"
sub = sub if os.path.isdir(sub) else os.path.join(here, sub)
rows = {}
for path in sorted(glob.glob(os.path.join(sub, "*", "results.md"))):
    m = re.match(r"(old|new)-(.+?)(-\d)?$", os.path.basename(os.path.dirname(path)))
    if not m:
        continue
    for line in open(path).read().splitlines()[2:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 11 or not cells[1].startswith("cost"):
            continue
        label = f"{m.group(1)} {cells[1]}"
        run = (cells[2], cells[5], float(cells[6]), cells[10])
        rows.setdefault(m.group(2), {}).setdefault(label, []).append(run)
for w, lines in rows.items():
    for label in ("old cost+replicas", "new cost+replicas", "new cost"):
        runs = lines.get(label)
        if runs:
            runs_s = "  ".join(f"{h}/{p}/{m:.1f}/{i}" for h, p, m, i in runs)
            print(f"{w:18} {label:18} mean {statistics.mean(r[2] for r in runs):6.1f}   (hit/p99/mean/imbalance) {runs_s}")
