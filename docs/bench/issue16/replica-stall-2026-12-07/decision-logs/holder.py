#!/usr/bin/env python3
"""Per glob of decision logs: how often the backend holding the longest match was over the load
guard (its formula: above the least loaded by 1.5x the mean load, at least its waiting requests,
and above 1.5x the least), and its requests in flight at each decision."""
import re,sys,glob,collections
for pat in sys.argv[1:]:
    n=0;trip=0;hold=collections.Counter()
    for f in glob.glob(pat):
        for line in open(f):
            if "decided" not in line: continue
            c=re.findall(r'"\d+ m(\d+) f(\d+)/(\d+) ',line)
            rows=[(int(m),int(w),int(i)) for m,w,i in c]
            if not rows: continue
            least=min(r[2] for r in rows); mean=sum(r[2] for r in rows)/len(rows)
            margin=min(max(1.5*mean,1),16)
            h=max(rows,key=lambda r:r[0])
            if h[0]==0: continue
            n+=1; hold[h[2]]+=1
            if h[2]>least+max(margin,min(h[1],16)) and h[2]>least*1.5: trip+=1
    print(pat,"n",n,"holder tripped",trip,"holder inflight dist",sorted(hold.items()))
