import glob, re, statistics, sys, datetime
def ts(s): return datetime.datetime.fromisoformat(s.rstrip('Z')).timestamp()
d=sys.argv[1]
for kind in ("cost","cost_replicas"):
    rows=[]
    for f in glob.glob(f"{d}/{kind}-*.log"):
        for line in open(f):
            if "first byte" not in line: continue
            kv=dict(re.findall(r"(\w+)=(\S+)",line)); fb=ts(line.split()[0]); t=float(kv['ttft']); p=float(kv['predicted'])
            rows.append(dict(b=kv['backend'],fb=fb,send=fb-t,t=t,p=p))
    for name,sel in (("other server prefilling meanwhile",True),("other server not prefilling",False)):
        rs=[r for r in rows if any(o['b']!=r['b'] and o['send']<r['fb'] and o['fb']>r['send'] for o in rows)==sel]
        if rs: print(kind,name,f"n={len(rs)} ttft mean {statistics.mean(r['t'] for r in rs)*1000:.1f} median {statistics.median(r['t'] for r in rs)*1000:.1f} ms, error median {statistics.median(abs(r['t']-r['p'])/r['t'] for r in rs):.0%}")
