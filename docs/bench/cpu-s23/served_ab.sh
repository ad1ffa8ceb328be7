#!/bin/bash
# Served sampled streams, A/B alternated: the torch filters (a worktree of 160e419 at
# /tmp/s23/old, `git worktree add /tmp/s23/old 160e419`, with this session's
# pdserve/bench/served_overhead.py copied in for --sampling) against the C filter (main).
# Output: docs/bench/served-overhead-s23/served_ab.txt and the JSON beside it.
S="temperature=1.0,top_p=0.95"
for r in 1 2; do
  for side in old main; do
    d=/tmp/s23/old; [ $side = main ] && d=/work/main
    cd $d && echo "== $side round $r" && /work/main/.venv/bin/python -m pdserve.bench.served_overhead --dtype float32 --streams 1,64 --sampling $S --json /tmp/s23/so-$side-$r.json 2>&1 | grep -E "^streams|CPU us"
  done
done
