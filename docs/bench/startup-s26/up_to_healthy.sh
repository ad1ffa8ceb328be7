#!/bin/bash
# Seconds from launching `pdserve up` (in repo dir $1, with this checkout's .venv) to its
# endpoints table; EXTRA="--model DIR" picks another model. To run an older commit:
#   git worktree add /tmp/old <rev>; PYTHONPATH=/tmp/old docs/bench/startup-s26/up_to_healthy.sh /tmp/old
VENV=$(cd "$(dirname "$0")/../../.." && pwd)/.venv
LOG=$(mktemp)
cd $1
t0=$(date +%s.%N)
$VENV/bin/python -m pdserve.cli up --http-port 18090 --grpc-port 0 --dtype float32 $EXTRA > $LOG 2>&1 &
pid=$!
while ! grep -q "Ctrl-C stops" $LOG 2>/dev/null; do sleep 0.1; if ! kill -0 $pid 2>/dev/null; then echo died; cat $LOG; exit 1; fi; done
t1=$(date +%s.%N)
echo "$1: healthy after $(echo "$t1 - $t0" | bc) s"
kill -INT $pid; wait $pid
