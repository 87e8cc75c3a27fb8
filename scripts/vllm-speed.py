"""Measures one vLLM server's speed as the simulator models it: time to first token for
uncached and cached prompts of several lengths, and the time between output tokens.

Usage: python3 scripts/vllm-speed.py URL [MODEL]   (a server of scripts/vllm-fleet.sh)
"""

import json
import random
import sys
import time
import urllib.request


def post(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    start = time.time()
    first = None
    with urllib.request.urlopen(req) as answer:
        data = b""
        for line in answer:
            if first is None:
                first = time.time() - start
            data += line
    return first, time.time() - start, data


def main(base, model):
    urllib.request.urlopen(
        urllib.request.Request(base + "/reset_prefix_cache", data=b"", method="POST")
    )
    words = ["river", "stone", "light", "paper", "garden", "window", "signal", "market"]
    print("| prompt tokens | TTFT uncached ms | TTFT cached ms |")
    print("|---|---|---|")
    for n in [250, 1000, 2000, 4000, 8000]:
        random.seed(n)
        prompt = " ".join(random.choice(words) + str(random.randint(0, 99)) for _ in range(n // 3))
        count = json.loads(post(base + "/tokenize", {"model": model, "prompt": prompt})[2])["count"]
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
        uncached = post(base + "/v1/completions", body)[0]
        cached = post(base + "/v1/completions", body)[0]
        print(f"| {count} | {uncached * 1000:.1f} | {cached * 1000:.1f} |")
    print()
    print("| output tokens | total ms | ms per token |")
    print("|---|---|---|")
    for m in [16, 64, 256]:
        body = {"model": model, "prompt": "hello", "max_tokens": m, "ignore_eos": True, "stream": True}
        total = post(base + "/v1/completions", body)[1]
        print(f"| {m} | {total * 1000:.0f} | {total * 1000 / m:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"), sys.argv[2] if len(sys.argv) > 2 else "tiny-llama")
