#!/bin/bash
# Tier CPU per streamed token from /proc (session 13, docs/benchmarks.md section 6): `pdserve up`,
# STREAMS (default 64) greedy streams of TOKENS (400) tokens at once, CPU seconds of every thread of
# every process over a WIN (20) s window after WARM (10) s, per token streamed in that window.
# usage, from the repository root (TREE=<checkout> to measure another tree):
#   docs/bench/cpu-s13/tier_cpu_burst.sh <outdir> [pdserve up args]
out=$1; shift; mkdir -p $out
here=$(cd "$(dirname "$0")" && pwd); py=$PWD/.venv/bin/python
cd ${TREE:-.}
$py -m pdserve.cli up --dtype ${DTYPE:-bfloat16} --http-port 18080 "$@" > "$out/up.log" 2>&1 &
pid=$!
for i in $(seq 180); do curl -sf localhost:18080/health >/dev/null && break; sleep 1; done
snap() { for k in $(pgrep -P $pid) $1; do for t in /proc/$k/task/*; do echo "$k $(basename $t) $(cut -d')' -f2 $t/stat | awk '{print $12+$13}') $(cat $t/comm | tr ' ' _)"; done; done; }
$py $here/burst_client.py http://localhost:18080 ${TOKENS:-400} ${STREAMS:-64} $out/ts.json > $out/client.txt 2>&1 &
client=$!
sleep ${WARM:-10}; date +%s.%N > $out/t0; snap $client > $out/s0; sleep ${WIN:-20}; date +%s.%N > $out/t1; snap $client > $out/s1
wait $client
kill $pid; wait $pid 2>/dev/null
cat $out/client.txt
python3 - $out $pid <<'PY'
import sys, json
d, gw = sys.argv[1], None
t0, t1 = float(open(d+"/t0").read()), float(open(d+"/t1").read())
ts = json.load(open(d+"/ts.json"))
n = sum(1 for s in ts for t in s if t0 <= t <= t1)
def load(f):
    return {(a,b):(int(c),n) for a,b,c,n in (l.split(None,3) for l in open(f))}
s0, s1 = load(d+"/s0"), load(d+"/s1")
print(f"{n} tokens in {t1-t0:.1f} s window")
pids = sorted({k[0] for k in s1})
for p in pids:
    rows = [(k[1], s1[k][1].strip(), (s1[k][0]-s0.get(k,(0,))[0])/100) for k in s1 if k[0]==p]
    rows = [r for r in rows if r[2] > 0]
    tot = sum(r[2] for r in rows)
    big = sorted(rows, key=lambda r: -r[2])
    eng = sum(r[2] for r in rows if r[1] == "pdserve-engine")
    print(f"pid {p}: {tot:.2f} s = {1e6*tot/n:.0f} us/token (outside engine threads {1e6*(tot-eng)/n:.0f}); threads: " + ", ".join(f"{r[1]}:{r[2]:.2f}" for r in big[:5]))
PY
