#!/bin/bash
# Served greedy streams with repetition_penalty 1.1, A/B alternated: the touched pairs rebuilt
# every step (a worktree of 628b42d at /tmp/s24/old, with this session's
# pdserve/bench/served_overhead.py copied in for the penalty keys) against the per-request
# tables (main).
S="temperature=0,repetition_penalty=1.1"
mkdir -p /tmp/s24/so
for r in 1 2; do
  for side in old main; do
    d=/tmp/s24/old; [ $side = main ] && d=/work/main
    cd $d && echo "== $side round $r" && /work/main/.venv/bin/python -m pdserve.bench.served_overhead --dtype float32 --streams 64 --rounds 1 --sampling $S --json /tmp/s24/so/rep-$side-$r.json 2>&1 | grep -E "^streams|CPU us"
  done
done
