#!/bin/bash
# Served float32 streams at 5 and 8 at once, A/B alternated: e1f6886 (panels past 4 rows,
# a worktree at /tmp/s24/head) against ff74b50 (the blocks' GEMV up to 8 rows, main).
mkdir -p /tmp/s24/so
for r in 1 2; do
  for side in head main; do
    d=/tmp/s24/head; [ $side = main ] && d=/work/main
    cd $d && echo "== $side round $r" && /work/main/.venv/bin/python -m pdserve.bench.served_overhead --dtype float32 --streams 5,8 --rounds 1 --json /tmp/s24/so/rows-$side-$r.json 2>&1 | grep -vE "^\s*$|loading|loaded"
  done
done
