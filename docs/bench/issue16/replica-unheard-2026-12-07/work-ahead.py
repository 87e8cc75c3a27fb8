#!/usr/bin/env python3
"""Per run folder (`bench compare` output with `--router-log warn,prefix_router::ttft=debug`):
how many streamed requests' first bytes counted less prefill work ahead than was there. From
every router's ttft debug lines (first byte time, TTFT, backend, work, uncached; `unheard`
where the binary adds peers' work heard late), the work truly ahead of a request is its own
uncached tokens plus those of every request (through any router) sent to the same backend
before it and answered after it was sent. Also the predicted TTFT at 2,208 tokens of a line
fitted (least squares of ttft + stalled over work) through the work learned from and through
the true work: the idle miss of a bursty prompt."""
import collections, datetime, glob, re, statistics, sys
pat = re.compile(r'^(\S+) DEBUG prefix_router::ttft: first byte backend=(\S+) work=(\d+)(?: unheard=(\d+))? uncached=(\d+) decoding=\d+ kv_usage=\S+ stalled_secs=(\S+) predicted=(\S+) ttft=(\S+)')
def ts(s): return datetime.datetime.fromisoformat(s.rstrip('Z')).timestamp()
def load(files):
    reqs = []
    for f in files:
        for line in open(f, errors="replace"):
            m = pat.match(line)
            if not m:
                continue
            t, b, w, late, u, st, p, tt = m.groups()
            fb, tt = ts(t), float(tt)
            reqs.append(dict(b=b, work=int(w) + int(late or 0), unc=int(u), st=float(st),
                             ttft=tt, fb=fb, send=fb - tt))
    return reqs
def fit(xs, ys):
    n = len(xs); mx = sum(xs) / n; my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs); sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else 0
    return my - b * mx, b
for d in sys.argv[1:]:
    for kind in ("cost_replicas", "cost"):
        reqs = load(sorted(glob.glob(f"{d}/{kind}-*.log")))
        if not reqs:
            continue
        byb = collections.defaultdict(list)
        for r in reqs:
            byb[r['b']].append(r)
        diff = []
        for r in reqs:
            r['true'] = r['unc'] + sum(s['unc'] for s in byb[r['b']]
                                       if s is not r and s['send'] < r['send'] < s['fb'])
            diff.append(r['true'] - r['work'])
        n, under = len(reqs), [x for x in diff if x > 0]
        ys = [r['ttft'] + r['st'] for r in reqs]
        a1, b1 = fit([r['work'] for r in reqs], ys)
        a2, b2 = fit([r['true'] for r in reqs], ys)
        print(f"{d.rstrip('/').split('/')[-1]:22s} {kind:13s} n={n} undercounted {len(under)} "
              f"({len(under)/n:.0%}, median {statistics.median(under) if under else 0:.0f} tokens), "
              f"overcounted {sum(x < 0 for x in diff)}; line at 2208: learned {1000*(a1+b1*2208):.0f} ms, "
              f"true {1000*(a2+b2*2208):.0f} ms")
