#!/usr/bin/env python3
"""Near-ties on 3 real vLLM servers: per workload and round, hit / p99 / mean / imbalance of
`cost` in turn (old: `turn % near`, a build of this tree with that one line) and drawn (new,
main), and `prefix_load`, from DIR/*/results.md (scripts/vllm-ab.sh's dirs; DIR: this folder
unless given, e.g. docs/bench/issue16/near-ties-2026-12-07b-3servers)."""
import glob, os, re, statistics, sys
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows = {}
for path in sorted(glob.glob(os.path.join(here, "*", "results.md"))):
    m = re.match(r"(old|new)-(.+?)(-\d)?$", os.path.basename(os.path.dirname(path)))
    if not m:
        continue
    for line in open(path).read().splitlines()[2:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 11 or cells[1] not in ("cost", "prefix_load"):
            continue
        label = {"old cost": "cost in turn", "new cost": "cost drawn"}.get(f"{m.group(1)} {cells[1]}", cells[1])
        rows.setdefault(m.group(2), {}).setdefault(label, []).append((cells[2], cells[5], float(cells[6]), cells[10]))
for w, lines in rows.items():
    for label in ("cost in turn", "cost drawn", "prefix_load"):
        runs = lines.get(label, [])
        if runs:
            runs_s = "  ".join(f"{h}/{p}/{m:.1f}/{i}" for h, p, m, i in runs)
            print(f"{w:18} {label:13} mean {statistics.mean(r[2] for r in runs):6.1f}   (hit/p99/mean/imbalance) {runs_s}")
