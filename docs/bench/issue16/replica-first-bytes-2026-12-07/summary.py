#!/usr/bin/env python3
"""Prints, per workload and round, `cost+replicas` through the binary before (old-*: each
replica learns from its own answers) and after (new-*: from every replica's, over the bus), and
one `cost` router where the new run has it: hit rate, mean TTFT ms, and the prediction's median
absolute error |observed - predicted| / observed over every streamed request, exact (from the
routers' `prefix_router::ttft` debug lines: `--router-log warn,prefix_router::ttft=debug`), with
the share of requests under 25 % error. DIR: `sims` or `vllm` beside this script, or a folder of
old-*/new-* runs."""
import glob, os, re, statistics, sys
here = os.path.dirname(os.path.abspath(__file__))
sub = sys.argv[1] if len(sys.argv) > 1 else "sims"
sub = sub if os.path.isdir(sub) else os.path.join(here, sub)
FIRST = re.compile(r"predicted=([0-9.e+-]+) ttft=([0-9.e+-]+)")
rows = {}
for run in sorted(glob.glob(os.path.join(sub, "*-*"))):
    m = re.match(r"(old|new)-(.+?)(-\d)?$", os.path.basename(run))
    if not m or not os.path.exists(os.path.join(run, "results.md")):
        continue
    figures = {}
    for line in open(os.path.join(run, "results.md")).read().splitlines()[2:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 6:
            figures[cells[1]] = (cells[2], float(cells[6]))
    for system in ("cost", "cost+replicas"):
        if system not in figures:
            continue
        errors = []
        prefix = system.replace("+", "_")
        for log in glob.glob(os.path.join(run, f"{prefix}-*.log")):
            for line in open(log, errors="replace"):
                f = FIRST.search(line)
                if f:
                    predicted, ttft = float(f.group(1)), float(f.group(2))
                    if ttft > 0:
                        errors.append(abs(ttft - predicted) / ttft)
        hit, mean = figures[system]
        rows.setdefault(m.group(2), {}).setdefault(f"{m.group(1)} {system}", []).append(
            (hit, mean, statistics.median(errors) if errors else None,
             sum(e < 0.25 for e in errors) / len(errors) if errors else None, len(errors)))
for w, lines in rows.items():
    for label in ("old cost+replicas", "new cost+replicas", "new cost"):
        runs = lines.get(label)
        if not runs:
            continue
        fmt = lambda r: f"{r[0]}/{r[1]:.1f}/" + (f"{r[2]:.0%}/{r[3]:.0%}/{r[4]}" if r[2] is not None else "-")
        print(f"{w:18} {label:18} mean {statistics.mean(r[1] for r in runs):6.1f}  "
              f"(hit/mean/error p50/under 25 %/first bytes) " + "  ".join(fmt(r) for r in runs))
