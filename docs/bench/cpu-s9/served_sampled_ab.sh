#!/bin/bash
# `pdserve up --dtype bfloat16` from each checkout given (a worktree of the old commit, then
# main), workload a sampled through the OpenAI API (docs/benchmarks.md section 6, session 9).
# usage: docs/bench/cpu-s9/served_sampled_ab.sh /path/to/old-worktree /path/to/main
py=/work/main/.venv/bin/python
here=$(cd "$(dirname "$0")" && pwd)
for dir in "$@"; do
  cd "$dir" || exit 1
  $py -m pdserve.cli up --dtype bfloat16 --http-port 18080 > /tmp/up.log 2>&1 &
  pid=$!
  for i in $(seq 90); do curl -sf localhost:18080/health >/dev/null && break; sleep 2; done
  echo "[$(git rev-parse --short HEAD)] $($py "$here/run_sampled.py" http://127.0.0.1:18080 | tail -1)"
  kill $pid; wait $pid 2>/dev/null; sleep 2
done
