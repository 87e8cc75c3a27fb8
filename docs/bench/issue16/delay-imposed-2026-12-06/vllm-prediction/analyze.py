"""Median relative error of the predicted TTFT in first-byte logs (prefix_router::ttft=debug),
overall and by thirds of the run, and the error of the best constant prediction for the
requests that had nothing queued ahead (the noise floor: no prediction from the router's facts
does better for them). Usage: python3 analyze.py LOG..."""

import re
import statistics as st
import sys

for path in sys.argv[1:]:
    rows = []
    for line in open(path):
        if "first byte" in line:
            d = dict(re.findall(r"(\w+)=(\S+)", line))
            rows.append((float(d["ttft"]), float(d["predicted"]), int(d["work"]), int(d["uncached"]), d["backend"]))
    err = [abs(p - o) / o for o, p, *_ in rows]
    signed = [(p - o) / o for o, p, *_ in rows]
    n = len(rows)
    thirds = [f"{st.median(signed[i * n // 3:(i + 1) * n // 3]):+.2f}" for i in range(3)]
    print(f"{path}: {n} first bytes, median |error| {st.median(err):.2f}, signed median by thirds {' '.join(thirds)}")
    for backend in sorted({r[4] for r in rows}):
        alone = [o for o, p, w, u, b in rows if b == backend and w == u]
        if len(alone) < 5:
            continue
        m = st.median(alone)
        floor = min(st.median([abs(c - x) / x for x in alone]) for c in [m * k / 100 for k in range(50, 150)])
        print(f"  {backend}: {len(alone)} alone, observed median {m * 1e3:.1f} ms, best constant's median |error| {floor:.2f}")
