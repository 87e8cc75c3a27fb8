#!/usr/bin/env python3
"""TTFT of fresh prompts alone, two at once on two servers, two at once on one server, and two
siblings (shared 600-word prefix) split or together: do the servers of a fleet slow each other
down (two vLLM CPU servers on one machine share its cores)? Streamed completions, max_tokens 1."""
import json, random, threading, time, urllib.request, statistics
import sys
# Two servers of a running fleet: python3 scripts/prefill-contention.py target/vllm-fleet/fleet.json
S=json.load(open(sys.argv[1]))["urls"][:2]
assert all(u.startswith("http://127.0.0.1:") for u in S), "loopback servers only"
words="alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu".split()
def text(n): return " ".join(random.choice(words) for _ in range(n))
def ttft(url, prompt, out):
    body=json.dumps({"model":"tiny-llama","prompt":prompt,"max_tokens":1,"stream":True}).encode()
    t=time.perf_counter()
    r=urllib.request.urlopen(urllib.request.Request(url+"/v1/completions",body,{"Content-Type":"application/json"}))
    r.readline()
    out.append((time.perf_counter()-t)*1000)
    r.read()
def run(pairs):
    out=[]; th=[threading.Thread(target=ttft,args=(u,p,out)) for u,p in pairs]
    [x.start() for x in th]; [x.join() for x in th]; return out
res={k:[] for k in "alone both_servers same_server siblings_split siblings_together".split()}
for i in range(8):
    res["alone"]+=run([(S[0],text(600))])
    res["both_servers"]+=run([(S[0],text(600)),(S[1],text(600))])
    res["same_server"]+=run([(S[0],text(600)),(S[0],text(600))])
    p=text(600)
    res["siblings_split"]+=run([(S[0],p+" q1 "+text(20)),(S[1],p+" q2 "+text(20))])
    p=text(600)
    res["siblings_together"]+=run([(S[0],p+" q1 "+text(20)),(S[0],p+" q2 "+text(20))])
for k,v in res.items(): print(f"{k:18s} n={len(v):2d} median {statistics.median(v):7.1f} ms  mean {statistics.mean(v):7.1f}")
