#!/usr/bin/env python3
"""Where a policy's requests left the backend holding their longest match, from a router's
decision log (`--log warn,prefix_router::decision=debug`; docs/bench/issue16/untried-2026-12-06/decisions/run.sh).
Usage: lost-hits.py LOG [LOG...]   (plain or .gz)"""
import gzip, re, sys
from collections import Counter

# id, matched tokens, in flight (the line's other fields are not used here)
CAND = re.compile(r'"(\d+) m(\d+) f\d+/(\d+) ')

def decisions(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            if "prefix_router::decision" not in line or "decided" not in line:
                continue
            reason = re.search(r'reason="(\w+)"', line).group(1)
            cands = [dict(id=c[0], m=int(c[1]), inflight=int(c[2])) for c in CAND.findall(line)]
            if cands:
                yield reason, cands

for path in sys.argv[1:]:
    kinds, reasons_lost, holders_load = Counter(), Counter(), []
    n = 0
    for reason, c in decisions(path):
        n += 1
        best = max(x["m"] for x in c)
        chosen = c[0]
        if best == 0:
            kinds["no backend holds any of it"] += 1
        elif chosen["m"] == best:
            kinds["hit (the longest match)"] += 1
        else:
            kinds["left the longest match"] += 1
            reasons_lost[reason] += 1
            least = min(x["inflight"] for x in c)
            mean = sum(x["inflight"] for x in c) / len(c)
            hs = [x for x in c if x["m"] == best]
            holders_load.append((len(hs), min(h["inflight"] for h in hs), least, round(mean, 1)))
    print(f"{path}: {n} decisions")
    for k, v in kinds.most_common():
        print(f"  {k}: {v}")
    print(f"  left the longest match, by reason: {dict(reasons_lost)}")
    if holders_load:
        print("  (holders, least in flight among holders, least in flight, mean in flight) for each:")
        print("   ", holders_load)

# Where the requests that no backend held (the prompts' first sight) were placed.
for path in sys.argv[1:]:
    first = Counter(c[0]["id"] for reason, c in decisions(path) if max(x["m"] for x in c) == 0)
    ids = {x["id"] for reason, c in decisions(path) for x in c}
    print(f"{path}: first sights per backend: {sorted((first.get(i, 0) for i in ids), reverse=True)}")
