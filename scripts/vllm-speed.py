"""Measures one vLLM server's speed as the simulator models it: time to first token for
uncached and cached prompts of several lengths, and the time between output tokens; then fits
the simulator's speed to it (a step of `--prefill-overhead-ms` plus the tokens at
`--prefill-tokens-per-s`, `--itl-ms` between output tokens).

Usage: python3 scripts/vllm-speed.py URL [MODEL]             the tables and the fitted flags
       python3 scripts/vllm-speed.py --sim-args URL [MODEL]  only the flags, for bench-vllm.sh
(URL: a server of `bench vllm-fleet`, otherwise idle.)
"""

import json
import random
import statistics
import sys
import time
import urllib.request

# Prompts the line is fitted on: one engine step each (vLLM's CPU default budget is 2,048
# tokens a step; longer prompts take several steps, which the sim models by itself).
FIT_UP_TO_TOKENS = 2048
TRIALS = 3


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


def reset(base):
    urllib.request.urlopen(
        urllib.request.Request(base + "/reset_prefix_cache", data=b"", method="POST")
    )


def prompt_of(words, seed):
    random.seed(seed)
    vocabulary = ["river", "stone", "light", "paper", "garden", "window", "signal", "market"]
    return " ".join(random.choice(vocabulary) + str(random.randint(0, 99)) for _ in range(words))


def prefill_times(base, model, words):
    """Median uncached and cached TTFT (s) of prompts of `words` words, and their tokens."""
    uncached, cached = [], []
    for trial in range(TRIALS):
        prompt = prompt_of(words, words * 100 + trial)
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
        uncached.append(post(base + "/v1/completions", body)[0])
        cached.append(post(base + "/v1/completions", body)[0])
    count = json.loads(post(base + "/tokenize", {"model": model, "prompt": prompt})[2])["count"]
    return count, statistics.median(uncached), statistics.median(cached)


def seconds_between_tokens(base, model, tokens):
    """Median time between output tokens of an answer of `tokens` tokens (TTFT left out)."""
    body = {"model": model, "prompt": "hello", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    gaps = []
    for _ in range(TRIALS):
        first, total, _ = post(base + "/v1/completions", body)
        gaps.append((total - first) / (tokens - 1))
    return statistics.median(gaps)


def fit_line(points):
    """Least-squares intercept and slope of (x, y) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def main(base, model, flags_only):
    reset(base)
    rows = [prefill_times(base, model, n // 3) for n in [250, 500, 1000, 1500, 2000, 4000, 8000]]
    itl = {m: seconds_between_tokens(base, model, m) for m in [16, 64, 256]}
    overhead, per_token = fit_line([(c, u) for c, u, _ in rows if c <= FIT_UP_TO_TOKENS])
    flags = (
        f"--prefill-tokens-per-s {1 / per_token:.0f} "
        f"--prefill-overhead-ms {max(overhead, 0.0) * 1000:.1f} --itl-ms {itl[64] * 1000:.2f}"
    )
    if flags_only:
        print(flags)
        return
    print(f"| prompt tokens | TTFT uncached ms (median of {TRIALS}) | TTFT cached ms |")
    print("|---|---|---|")
    for count, uncached, cached in rows:
        print(f"| {count} | {uncached * 1000:.1f} | {cached * 1000:.1f} |")
    print()
    print("| output tokens | ms between tokens |")
    print("|---|---|")
    for m, gap in itl.items():
        print(f"| {m} | {gap * 1000:.2f} |")
    print()
    print(f"sim flags (line fitted on prompts up to {FIT_UP_TO_TOKENS} tokens): {flags}")


if __name__ == "__main__":
    args = sys.argv[1:]
    flags_only = "--sim-args" in args
    args = [a for a in args if a != "--sim-args"]
    main(args[0].rstrip("/"), args[1] if len(args) > 1 else "tiny-llama", flags_only)
