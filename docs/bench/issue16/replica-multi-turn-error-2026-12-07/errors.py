#!/usr/bin/env python3
"""Median prediction error |observed - predicted| / observed of the streamed first bytes in a
`bench compare` run folder (`--router-log warn,prefix_router::ttft=debug`), per system: all,
the first 48 by time and the rest, per backend, and by the requests decoding at the backend
when sent."""
import collections, glob, re, statistics, sys
for d in sys.argv[1:]:
    for kind in ("cost", "cost_replicas"):
        rows = []
        for f in glob.glob(f"{d}/{kind}-*.log"):
            for line in open(f, errors="replace"):
                if "first byte" not in line:
                    continue
                kv = dict(re.findall(r"(\w+)=(\S+)", line))
                p, t = float(kv["predicted"]), float(kv["ttft"])
                rows.append((line[:27], kv["backend"][-5:], int(kv["decoding"]), int(kv["work"]), p, t, abs(t - p) / t))
        if not rows:
            continue
        rows.sort()
        med = lambda rs: f"{statistics.median(r[6] for r in rs):.0%} (n={len(rs)}, ttft {statistics.mean(r[5] for r in rs)*1000:.1f}, pred {statistics.mean(r[4] for r in rs)*1000:.1f} ms)" if rs else "-"
        print(f"{d.rstrip('/').split('/')[-1]} {kind}: all {med(rows)}; first 48 {med(rows[:48])}; rest {med(rows[48:])}")
        for b in sorted({r[1] for r in rows}):
            print(f"   backend {b}: {med([r for r in rows if r[1] == b])}")
        for dec in sorted({r[2] for r in rows}):
            print(f"   decoding {dec}: {med([r for r in rows if r[2] == dec])}")
