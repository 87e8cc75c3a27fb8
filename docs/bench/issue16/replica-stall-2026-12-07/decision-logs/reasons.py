#!/usr/bin/env python3
"""Per glob of decision logs (bench compare --router-log warn,prefix_router::decision=debug): decisions,
their reasons, how many chose a backend holding less than the best match, how many had no match."""
import re,sys,collections,glob
for pat in sys.argv[1:]:
    c=collections.Counter(); lost=0; n=0; zero_best=0
    for f in glob.glob(pat):
        for line in open(f):
            if "decided" not in line: continue
            n+=1
            reason=re.search(r'reason="(\w+)"',line).group(1); c[reason]+=1
            ms=[int(x) for x in re.findall(r'"\d+ m(\d+) ',line)]
            if ms and ms[0]<max(ms): lost+=1
            if ms and max(ms)==0: zero_best+=1
    print(pat,n,dict(c),"chosen<best",lost,"nobody-holds",zero_best)
