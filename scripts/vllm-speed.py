"""Measures one vLLM server's speed as the simulator models it: time to first token for
uncached and cached prompts of several lengths, and the time between output tokens; then fits
the simulator's speed to it (a step of `--prefill-overhead-ms` plus the tokens at
`--prefill-tokens-per-s`, `--itl-ms` between output tokens).

Usage: python3 scripts/vllm-speed.py URL [MODEL]             the tables and the fitted flags
       python3 scripts/vllm-speed.py --sim-args URL [MODEL]  only the flags, for bench-vllm.sh
       python3 scripts/vllm-speed.py --from-requests "FLAGS" DIR...
       python3 scripts/vllm-speed.py --correct "FLAGS" DIR...
(URL: a server of `bench vllm-fleet`, otherwise idle.)

With `--from-requests`, FLAGS (the probe's, from `--sim-args`) come back with the step overhead
and prefill rate fitted instead on the requests a `bench compare --fleet vllm` run recorded in
DIR... (its `requests/*.jsonl`) that met an idle fleet: no
other request of their run in flight when they were sent. Those pay what the idle probe above
does not see and the benchmark does (on a CPU fleet: the worker threads waking after a pause,
the chat template, the router), so the sims start from the speed the benchmark meets; what
happens when requests overlap (queueing, batching, contention) is left for the sims to predict.
The time between tokens stays the probe's.

With `--correct`, FLAGS (from the fit above) come back with the step overhead less what the sims
add by themselves to a request that meets an idle fleet (the router, HTTP, timers: the median of
TTFT − step over the requests a sim run at FLAGS recorded in DIR...): the fitted intercept holds
the router and HTTP of the vLLM runs already, and the sims would count them twice.
"""

import glob
import json
import os
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
    uncached, cached, counts = [], [], []
    for trial in range(TRIALS):
        prompt = prompt_of(words, words * 100 + trial)
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
        uncached.append(post(base + "/v1/completions", body)[0])
        cached.append(post(base + "/v1/completions", body)[0])
        tokenized = post(base + "/tokenize", {"model": model, "prompt": prompt})[2]
        counts.append(json.loads(tokenized)["count"])
    return statistics.median(counts), statistics.median(uncached), statistics.median(cached)


def seconds_between_tokens(base, model, tokens):
    """Median time between output tokens of an answer of `tokens` tokens (TTFT left out): the
    end of the answer against the end of a one-token answer to the same prompt. Not the
    stream's own gaps: vLLM's API server sometimes sends a whole answer at once (seen here:
    256 tokens within 3 ms, 576 ms after the request), which read as no time between tokens."""

    def e2e(max_tokens):
        body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        return statistics.median(post(base + "/v1/completions", body)[1] for _ in range(TRIALS))

    return (e2e(tokens) - e2e(1)) / (tokens - 1)


def fit_line(points):
    """Least-squares intercept and slope of (x, y) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def alone_requests(dirs):
    """(uncached tokens, TTFT s) of the recorded requests no other request of their run
    overlapped; exits when there are too few to fit on."""
    from recorded_requests import load, split_by_overlap

    points = []
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.jsonl"))):
            alone, _ = split_by_overlap(load(path))
            points += [(r["prompt_tokens"] - r["cached_tokens"], r["ttft"]) for r in alone]
    if len(points) < 20:
        sys.exit(f"only {len(points)} requests met an idle fleet in {dirs}; need 20")
    return points


def fit_robust(points):
    """Theil–Sen line: the median of the pairwise slopes, then the median intercept; a few
    stalled requests do not tilt it as they would a least-squares line."""
    xs = sorted(points)
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1) in enumerate(xs)
        for x2, y2 in xs[i + 1 :]
        if x2 - x1 >= 32
    ]
    slope = statistics.median(slopes)
    return statistics.median(y - slope * x for x, y in points), slope


def sim_flags(overhead, per_token, itl):
    """The sim's speed flags from a step overhead (s), seconds per token and between tokens."""
    return (
        f"--prefill-tokens-per-s {1 / per_token:.0f} "
        f"--prefill-overhead-ms {max(overhead, 0.0) * 1000:.1f} --itl-ms {itl * 1000:.2f}"
    )


def parse_flags(flags):
    """(overhead s, seconds per token, between tokens s) of `sim_flags`' text."""
    words = flags.split()

    def value(name):
        return float(words[words.index(name) + 1])

    return (
        value("--prefill-overhead-ms") / 1000,
        1 / value("--prefill-tokens-per-s"),
        value("--itl-ms") / 1000,
    )


def fitted_on_requests(flags, vllm_dirs):
    """`flags` with the overhead and rate fitted on the vLLM runs' requests that met an idle fleet."""
    _, _, itl = parse_flags(flags)
    overhead, per_token = fit_robust(alone_requests(vllm_dirs))
    return sim_flags(overhead, per_token, itl)


def corrected(flags, sim_dirs):
    """`flags` with the sims' own latency taken off the step overhead."""
    overhead, per_token, itl = parse_flags(flags)
    own = statistics.median(
        ttft - overhead - uncached * per_token for uncached, ttft in alone_requests(sim_dirs)
    )
    return sim_flags(overhead - own, per_token, itl)


def main(base, model, flags_only):
    reset(base)
    rows = [prefill_times(base, model, n // 3) for n in [250, 500, 1000, 1500, 2000, 4000, 8000]]
    itl = {m: seconds_between_tokens(base, model, m) for m in [16, 64, 256]}
    overhead, per_token = fit_line([(c, u) for c, u, _ in rows if c <= FIT_UP_TO_TOKENS])
    flags = sim_flags(overhead, per_token, itl[64])
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
    if args and args[0] in ("--from-requests", "--correct"):
        adjust = fitted_on_requests if args[0] == "--from-requests" else corrected
        print(adjust(args[1], args[2:]))
        sys.exit(0)
    flags_only = "--sim-args" in args
    args = [a for a in args if a != "--sim-args"]
    main(args[0].rstrip("/"), args[1] if len(args) > 1 else "tiny-llama", flags_only)
