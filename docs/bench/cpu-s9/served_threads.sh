#!/bin/bash
# Per-thread CPU seconds and context switches of the worker and gateway while one peers
# workload replays against `pdserve up` (session 9, docs/benchmarks.md section 6).
# usage: docs/bench/cpu-s9/served_threads.sh DTYPE WORKLOAD "VAR=VAL ..."|-
# run from the repository root
d=docs/bench/cpu-s9
envs=""; [ "$3" != "-" ] && envs="$3"
env $envs .venv/bin/python -m pdserve.cli up --dtype "$1" --http-port 18080 > /tmp/up.log 2>&1 &
pid=$!
for i in $(seq 90); do curl -sf localhost:18080/health >/dev/null && break; sleep 2; done
W=$(pgrep -f "pdserve.decode_worker"); G=$(pgrep -f "pdserve.gateway")
python3 $d/threads.py "$W" /tmp/tw0.json; python3 $d/threads.py "$G" /tmp/tg0.json
res=$(.venv/bin/python $d/run_workload.py http://127.0.0.1:18080 "$2" 2>&1 | tail -1)
python3 $d/threads.py "$W" /tmp/tw1.json; python3 $d/threads.py "$G" /tmp/tg1.json
echo "[$3] $res"
python3 $d/threads_diff.py /tmp/tw0.json /tmp/tw1.json
python3 $d/threads_diff.py /tmp/tg0.json /tmp/tg1.json
kill $pid; wait $pid 2>/dev/null
