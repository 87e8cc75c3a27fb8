#!/usr/bin/env python3
"""Writes an agent-like trace for `bench compare --workload trace --trace FILE`.

24 agents, each with its own 1,500-token system prompt (tools, instructions); tasks arrive at
12/s (Poisson), each fanning out into 1-4 sibling requests 2 ms apart; every request is a
streamed chat with a 60-300-token user turn and 16-32 output tokens (722 requests, 29 s).
Usage: scripts/agent-trace.py OUT.jsonl [MODEL]
"""
import json
import random
import sys

out_path = sys.argv[1]
model = sys.argv[2] if len(sys.argv) > 2 else "sim-model"
rng = random.Random(7)


def text(tokens):
    """About `tokens` tokens (4 bytes each) of random three-letter words."""
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3))
        for _ in range(tokens)
    )


agents = [text(1500) for _ in range(24)]
t = 0.0
n = 0
with open(out_path, "w") as out:
    while n < 720:
        t += rng.expovariate(12.0)
        agent = agents[rng.randrange(len(agents))]
        for j in range(rng.choice([1, 1, 2, 3, 4])):
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": agent},
                    {"role": "user", "content": text(rng.randint(60, 300))},
                ],
                "max_tokens": rng.randint(16, 32),
                "stream": True,
            }
            line = {"t": round(t + j * 0.002, 4), "endpoint": "chat", "body": body}
            out.write(json.dumps(line) + "\n")
            n += 1
print(f"{n} requests over {t:.1f} s in {out_path}", file=sys.stderr)
