#!/usr/bin/env python3
"""Does one CPU vLLM server slow down while the other computes? TTFT of short streamed
completions (~300-token prompts, 1 token) at server A, sequentially, with server B idle, then
with B kept busy by a loop of long prompts, then idle again. Usage: contention.py FLEET_JSON"""
import json, sys, threading, time, urllib.request, statistics, random
urls = json.load(open(sys.argv[1]))["urls"]
a, b = urls
def words(n, seed):
    r = random.Random(seed)
    return " ".join(r.choice(["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple"]) for _ in range(n))
def ttft(url, prompt, max_tokens=1):
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        first = None
        for line in r:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - t0
        return first
def phase(name, n=30):
    ts = [ttft(a, words(300, random.random())) * 1000 for _ in range(n)]
    print(f"{name}: A's TTFT median {statistics.median(ts):.1f} ms, mean {statistics.mean(ts):.1f}, p90 {sorted(ts)[int(0.9*n)]:.1f}", flush=True)
busy = threading.Event()
def loop():
    while busy.is_set():
        ttft(b, words(1500, random.random()), 32)
phase("B idle")
busy.set(); th = threading.Thread(target=loop); th.start(); time.sleep(1)
phase("B busy")
busy.clear(); th.join()
phase("B idle again")
