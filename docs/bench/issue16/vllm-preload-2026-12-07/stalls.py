#!/usr/bin/env python3
"""Per run folder (DIR/W/requests/SYSTEM.jsonl): requests, those over 150 ms TTFT, and mean / p50 TTFT ms."""
import glob, json, statistics, sys
for f in sorted(glob.glob(f"{sys.argv[1] if len(sys.argv) > 1 else '.'}/*/*/requests/*.jsonl")):
    t = sorted(json.loads(l)["ttft"] * 1000 for l in open(f))
    print(f"{f:55} n={len(t):3} over 150 ms: {sum(x > 150 for x in t):2}  mean {statistics.mean(t):6.1f}  p50 {statistics.median(t):5.1f}")
