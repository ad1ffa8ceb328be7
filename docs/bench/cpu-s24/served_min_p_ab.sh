#!/bin/bash
# Served min-p streams, A/B alternated: the torch stages (a worktree of 628b42d at
# /tmp/s24/old, `git worktree add /tmp/s24/old 628b42d`) against the C filter (main).
S="temperature=1.0,min_p=0.05"
mkdir -p /tmp/s24/so
for r in 1 2; do
  for side in old main; do
    d=/tmp/s24/old; [ $side = main ] && d=/work/main
    cd $d && echo "== $side round $r" && /work/main/.venv/bin/python -m pdserve.bench.served_overhead --dtype float32 --streams 1,64 --rounds 1 --sampling $S --json /tmp/s24/so/min_p-$side-$r.json 2>&1 | grep -E "^streams|CPU us|served"
  done
done
