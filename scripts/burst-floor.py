"""Splits a bursty run's requests into each burst's first request and its siblings: the first
one's TTFT (an uncached prompt on an idle fleet) is the floor no routing of the siblings beats.

Usage: python3 scripts/burst-floor.py DIR/requests/*.jsonl   (from `bench compare --workload bursty`)
"""

import json
import statistics
import sys

# Requests sent within this many seconds of the previous one belong to the same burst.
BURST_GAP_S = 0.5

print("| run | bursts | first TTFT median / mean ms | siblings median / mean ms |")
print("|---|---|---|---|")
for path in sys.argv[1:]:
    requests = sorted((json.loads(line) for line in open(path)), key=lambda r: r["sent_at"])
    bursts = []
    for r in requests:
        if bursts and r["sent_at"] - bursts[-1][-1]["sent_at"] <= BURST_GAP_S:
            bursts[-1].append(r)
        else:
            bursts.append([r])
    first = [b[0]["ttft"] * 1000 for b in bursts]
    siblings = [r["ttft"] * 1000 for b in bursts for r in b[1:]]
    print(
        f"| {path} | {len(bursts)} | {statistics.median(first):.1f} / {statistics.mean(first):.1f}"
        f" | {statistics.median(siblings):.1f} / {statistics.mean(siblings):.1f} |"
    )
