"""The requests a `bench compare` run recorded (`requests/<system>.jsonl`), split by whether
they met an idle fleet: the ones no other request of their run overlapped show a server's own
speed, the others also what concurrent work costs (queueing, batching, on a CPU fleet the cores
the servers share). Used by vllm-speed.py (to fit the sims on the first) and fidelity.py (to show
where the sims and vLLM part).
"""

import json


def load(path):
    """The successful requests of one run, each with a TTFT."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("ok") and r.get("ttft") is not None]


def split_by_overlap(rows):
    """(alone, overlapped): whether another request was in flight when each was sent."""
    spans = [(r["sent_at"], r["sent_at"] + r["e2e"]) for r in rows]
    alone, overlapped = [], []
    for r in rows:
        t = r["sent_at"]
        in_flight = sum(1 for start, end in spans if start <= t < end)
        (overlapped if in_flight > 1 else alone).append(r)
    return alone, overlapped
