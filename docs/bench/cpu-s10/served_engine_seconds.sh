#!/bin/bash
# One peers workload through `pdserve up`, and the decode worker's engine counters over it
# (pdserve:engine_steps_total, engine_step_seconds_total, engine_forward_seconds_total).
# usage: docs/bench/cpu-s10/served_engine_seconds.sh DTYPE WORKLOAD [pdserve up args]
# run from the repository root; env is passed on (e.g. OMP_WAIT_POLICY= GOMP_SPINCOUNT=10000)
dt=$1; w=$2; shift 2
log=$(mktemp)
.venv/bin/python -m pdserve.cli up --dtype "$dt" --http-port 18080 "$@" > "$log" 2>&1 &
pid=$!
for i in $(seq 120); do curl -sf localhost:18080/health >/dev/null && break; sleep 2; done
M=$(grep -E "^\s+decode-0 " "$log" | grep -o "metrics http[^ ]*")
M=${M#metrics }
snap() { curl -s "$M" | grep -E "^pdserve:engine_(steps|step_seconds|forward_seconds)_total" \
         | awk '{print $NF}' | tr '\n' ' '; }
a=$(snap)
.venv/bin/python docs/bench/cpu-s9/run_workload.py http://127.0.0.1:18080 "$w" 2>&1 | tail -1
b=$(snap)
python3 -c "
a=[float(x) for x in '$a'.split()]; b=[float(x) for x in '$b'.split()]
print('decode worker: %d steps, steps %.2f s, forwards %.2f s' % tuple(y-x for x,y in zip(a,b)))"
kill $pid; wait $pid 2>/dev/null
rm -f "$log"
