"""Replays the router's prefill model (crates/prefix-router/src/core/prefill.rs) over recorded
first-byte logs (prefix_router::ttft=debug), in their order, per backend: each answer is
predicted by the model as it stood (the line at its work, less the time the queue was already
under way, as `ttft_after_queue`; KV pressure was 0 in these runs), then taught to it. The same
observations through two versions of the model is a paired comparison: the run-to-run noise of
a real fleet (the median error of one binary moved 0.15-0.49 between runs) cancels out.

`before`: least squares with an observation clipped at 3x the line + 50 ms, calibration 3 % a
step. `after`: clipped at two spreads above the line (spread: recent mean distance from it, at
first half the prediction, at least a tenth), calibration 1/(8 + answers so far) a step until
that is under 3 %. Replaying `before` over a log it produced reproduces the logged error
(and `after` over its own). Printed per log: the median |error| logged, replayed before and
after; after, from the 33rd answer on (past a fresh router's start) and for the answers that had
nothing queued ahead and nothing decoding ("alone"); and the best constant's median |error| for
those alone, each backend its own (the fleet's noise floor). Usage: python3 replay.py LOG...
"""

import re
import statistics as st
import sys

DECAY, PRIOR_WEIGHT, PRIOR_OVERHEAD, PRIOR_SPT, PRIOR_SPAN = 0.98, 0.5, 0.02, 1e-4, 2048.0
VERSIONS = {
    "before": dict(spread=False, early_offset=None),
    "after": dict(spread=True, prior_spread=0.5, clip_spreads=2.0, spread_step=0.2, min_spread=0.1, early_offset=8.0),
}


class Model:
    def __init__(self, v):
        self.v = v
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.n = 0
        self.line = (PRIOR_OVERHEAD, PRIOR_SPT)
        self.cal = 1.0
        self.spread = None

    def bare(self, work):
        return self.line[0] + self.line[1] * work

    def ttft(self, work):
        return self.bare(work) * self.cal

    def fit(self):
        h = PRIOR_WEIGHT / (1 + self.w) / 2
        x1, y1 = PRIOR_SPAN, PRIOR_OVERHEAD + PRIOR_SPT * PRIOR_SPAN
        w = self.w + 2 * h
        x, y = self.x + h * x1, self.y + h * (PRIOR_OVERHEAD + y1)
        xx, xy = self.xx + h * x1 * x1, self.xy + h * x1 * y1
        mx, my = x / w, y / w
        var, cov = xx / w - mx * mx, xy / w - mx * my
        slope = max(cov / var if var > 1e-9 else PRIOR_SPT, 1e-8)
        overhead = my - slope * mx
        self.line = (0.0, max(xy / xx, 1e-8)) if overhead < 0 and xx > 0 else (max(overhead, 0.0), slope)

    def add(self, work, t):
        line = self.bare(work)
        v = self.v
        if v["spread"]:
            s = max(self.spread if self.spread is not None else line * v["prior_spread"], line * v["min_spread"])
            y = min(t, line + v["clip_spreads"] * s)
            self.spread = s + v["spread_step"] * (abs(y - line) - s)
        else:
            y = min(t, line * 3 + 0.05)
        x = float(work)
        self.w = self.w * DECAY + 1
        self.x = self.x * DECAY + x
        self.y = self.y * DECAY + y
        self.xx = self.xx * DECAY + x * x
        self.xy = self.xy * DECAY + x * y
        self.n += 1
        self.fit()

    def calibrate(self, predicted, t):
        size = 0.03
        if self.v["early_offset"]:
            size = max(size, 1 / (self.v["early_offset"] + self.n))
        if t > predicted:
            self.cal *= 1 + size
        elif t < predicted:
            self.cal /= 1 + size
        self.cal = min(max(self.cal, 0.25), 4.0)


def predict(m, r):
    own = m.ttft(r["uncached"])
    return own + abs(m.ttft(r["work"]) - own - r["stalled_secs"])


def errors(rows, version):
    models, out = {}, []
    for r in rows:
        m = models.setdefault(r["backend"], Model(VERSIONS[version]))
        out.append(abs(predict(m, r) - r["ttft"]) / r["ttft"])
        m.calibrate(predict(m, r), r["ttft"])
        m.add(r["work"], r["ttft"] + r["stalled_secs"])
    return out


def best_constant_errors(ttfts):
    """The errors of the one constant with the least median error over `ttfts`."""
    m = st.median(ttfts)
    candidates = ([abs(c - x) / x for x in ttfts] for c in (m * k / 100 for k in range(50, 150)))
    return min(candidates, key=st.median)


for path in sys.argv[1:]:
    rows = []
    for line in open(path):
        if "first byte" in line:
            d = dict(re.findall(r"(\w+)=(\S+)", line))
            rows.append({k: float(d[k]) for k in ("work", "uncached", "stalled_secs", "predicted", "ttft", "decoding")} | {"backend": d["backend"]})
    logged = st.median(abs(r["predicted"] - r["ttft"]) / r["ttft"] for r in rows)
    before, after = errors(rows, "before"), errors(rows, "after")
    alone = [i for i, r in enumerate(rows) if i >= 32 and r["work"] == r["uncached"] and r["decoding"] == 0]
    floor = []
    for b in {r["backend"] for r in rows}:
        ttfts = [rows[i]["ttft"] for i in alone if rows[i]["backend"] == b]
        floor += best_constant_errors(ttfts) if len(ttfts) >= 5 else []
    floor = st.median(floor)
    print(f"{path}: {len(rows)} first bytes, median |error| logged {logged:.2f}, replayed before {st.median(before):.2f}, "
          f"after {st.median(after):.2f}; after, from the 33rd {st.median(after[32:]):.2f}, alone {st.median(after[i] for i in alone):.2f} "
          f"(best constant {floor:.2f})")
