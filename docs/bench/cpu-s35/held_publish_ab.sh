#!/bin/bash
# Served TPOT and the engine's step / forward, alternating two trees' clusters ROUNDS times,
# three 512-token float32 streams each (served_step_decomp.py). Session 35:
#   OLD=a worktree at e8ef08b, NEW=the same with held_publish.patch applied
#   (git worktree add /tmp/old e8ef08b; git worktree add /tmp/new e8ef08b;
#    git -C /tmp/new apply docs/bench/cpu-s35/held_publish.patch)
# usage: OLD=/tmp/old NEW=/tmp/new docs/bench/cpu-s35/held_publish_ab.sh ROUNDS  (from the repo root)
here=$(pwd)
for i in $(seq 1 "$1"); do
  for side in old new; do
    if [ $side = old ]; then dir=$OLD; else dir=$NEW; fi
    (cd "$dir" && PYTHONPATH=$dir setsid "$here/.venv/bin/python" -m pdserve.cli up --dtype float32 \
      --http-port 18000 --grpc-port 18001 --log-dir /tmp/held_ab_logs > /tmp/held_ab_up.log 2>&1) &
    P=$!
    for _ in $(seq 1 60); do grep -q "pdserve is up" /tmp/held_ab_up.log && break; sleep 1; done
    "$here/.venv/bin/python" docs/bench/cpu-s35/served_step_decomp.py 3 | sed "s/^/$side /"
    pkill -TERM -g "$(ps -o pgid= -p $P | tr -d ' ')" 2>/dev/null; wait $P 2>/dev/null; sleep 3
  done
done
