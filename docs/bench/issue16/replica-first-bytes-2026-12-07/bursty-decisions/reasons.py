#!/usr/bin/env python3
"""Bursty through 4 replicas, before (old: each replica learns from its own first bytes) and after
(new: from all): the decisions' reasons, and the median predicted TTFT of an idle backend that
holds nothing of the prompt (m0 f0/0 q0), from the routers' decision logs (`bench compare
--workload bursty --sim-servers 8 --sim-args "--kv-blocks 3000" --overhead-requests 0
--throughput-secs 0 --replica-bus nats://127.0.0.1:4222 --systems cost+replicas --router-log
warn,prefix_router::decision=debug`)."""
import collections, glob, os, re, statistics
here = os.path.dirname(os.path.abspath(__file__))
for v in ("old", "new"):
    reasons, idle = collections.Counter(), []
    for f in glob.glob(os.path.join(here, v, "cost_replicas-*.log")):
        for line in open(f):
            if "decided" not in line:
                continue
            reasons[re.search(r'reason="(\w+)"', line).group(1)] += 1
            for m, w, q, p in re.findall(r'"\d+ m(\d+) f(\d+)/\d+ q(\d+) u\d+ms p(\d+)ms', line):
                if m == w == q == "0":
                    idle.append(int(p))
    print(v, dict(sorted(reasons.items())), "idle backend, prompt not held: predicted median",
          statistics.median(idle), "ms")
