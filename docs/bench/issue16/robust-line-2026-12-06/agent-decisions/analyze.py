"""Where `cost`'s TTFT goes on the agent trace: the first-byte log's requests by kind (a hit
or a miss of the agent's 1,500-token prompt, alone or queued behind others there), and the
decisions that sent a request to a backend without the prompt while another held it.
Usage: python3 analyze.py LOG  (LOG from decisions/run.sh EXE "trace --trace target/agent.jsonl" cost OUT)"""
import collections
import re
import statistics as st
import sys

MISS = 1000  # uncached tokens above which a request computed the agent's prompt
HOLDS = 1400  # matched tokens from which a backend holds it
rows = []
decisions = collections.Counter()
for line in open(sys.argv[1]):
    if "first byte" in line:
        d = dict(re.findall(r"(\w+)=(\S+)", line))
        kind = ("miss" if float(d["uncached"]) > MISS else "hit") + (" queued" if d["work"] != d["uncached"] else " alone")
        rows.append((kind, float(d["ttft"]) * 1e3))
    elif "decided" in line:
        reason = re.search(r'reason="(\w+)"', line).group(1)
        matched = [int(m) for m in re.findall(r'"\d+ m(\d+) ', line)]
        if matched[0] < HOLDS:
            decisions[(reason, "someone held it" if max(matched) >= HOLDS else "nobody held it")] += 1
total = sum(t for _, t in rows)
print(f"{len(rows)} first bytes, mean TTFT {total / len(rows):.1f} ms")
for kind in sorted({k for k, _ in rows}):
    ts = [t for k, t in rows if k == kind]
    print(f"  {kind:13s} {len(ts):4d}  mean {st.mean(ts):6.1f} ms  share of all TTFT {sum(ts) / total:.2f}")
print("requests sent without the prompt, by decision:")
for k, v in sorted(decisions.items()):
    print(f"  {k[0]:13s} ({k[1]}): {v}")
