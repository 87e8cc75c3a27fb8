"""Splits a bursty run's requests into each burst's first request and its siblings: the first
one's TTFT (an uncached prompt on an idle fleet) is the floor no routing of the siblings beats.

Usage: python3 scripts/burst-floor.py [--gap SECONDS] DIR/requests/*.jsonl
  (from `bench compare --workload bursty`). Requests sent within --gap seconds of the previous
  one belong to the same burst: 0.5 (the default) for the CPU fleet's bursts every ~2 s, 0.02
  for the sims' default workload (4 bursts/s, each within 5 ms).
"""

import json
import statistics
import sys

args = sys.argv[1:]
BURST_GAP_S = 0.5
if args[:1] == ["--gap"]:
    BURST_GAP_S = float(args[1])
    args = args[2:]

print("| run | bursts | first TTFT median / mean ms | siblings median / mean ms |")
print("|---|---|---|---|")
for path in args:
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
