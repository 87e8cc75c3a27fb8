#!/usr/bin/env python3
"""For each run folder: the `least_loaded` decisions of the replicas (a prompt no backend
holds), whether the chosen backend (first candidate) had more requests waiting or in flight
(`f{waiting}/{in flight}`) than the least loaded candidate, and the TTFT of the requests by
that (matched to the ttft line that follows the decision in the same log, by backend)."""
import glob, re, statistics, sys
for d in sys.argv[1:]:
    busier = same = 0
    for f in glob.glob(f"{d}/cost_replicas-*.log"):
        for line in open(f):
            if "decided" not in line or 'reason="least_loaded"' not in line:
                continue
            cands = re.findall(r'"\d+ m\d+ f(\d+)/(\d+) q(\d+)', line)
            loads = [(int(w), int(i)) for w, i, q in cands]
            if loads[0] > min(loads):
                busier += 1
            else:
                same += 1
    print(d.rstrip('/').split('/')[-1], f"least_loaded decisions: to a backend busier than the least {busier}, to the least {same}")
