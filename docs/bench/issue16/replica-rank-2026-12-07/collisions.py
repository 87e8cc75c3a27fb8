import glob, re, sys, datetime, collections
def ts(s): return datetime.datetime.fromisoformat(s.rstrip('Z')).timestamp()
for d in sys.argv[1:]:
    decs=[]
    for i,f in enumerate(sorted(glob.glob(f"{d}/cost_replicas-*.log"))):
        for line in open(f):
            if "decided" not in line: continue
            reason=re.search(r'reason="(\w+)"',line).group(1)
            first=re.search(r'candidates=\["(\d+) m(\d+)',line)
            decs.append((ts(line.split()[0]),i,reason,first.group(1),int(first.group(2))))
    decs.sort()
    coll=collections.Counter(); tot=collections.Counter()
    for k,(t,i,r,b,m) in enumerate(decs):
        tot[r]+=1
        if any(j!=i and bb==b and 0<=t-tt<0.005 for (tt,j,rr,bb,mm) in decs[max(0,k-20):k]):
            coll[r]+=1
    print(d, "decisions by reason", dict(tot), "sent within 5 ms after a peer's to the same backend", dict(coll))
