import json, sys, time, urllib.request, statistics, random
urls = json.load(open(sys.argv[1]))["urls"]
def words(n, seed):
    r = random.Random(seed)
    return " ".join(r.choice(["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple"]) for _ in range(n))
def ttft(url, prompt):
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        first = None
        for line in r:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - t0
        return first
for rnd in range(2):
    for u in urls:
        ts = [ttft(u, words(300, random.random())) * 1000 for _ in range(30)]
        print(u, f"idle TTFT median {statistics.median(ts):.1f} mean {statistics.mean(ts):.1f} ms", flush=True)
