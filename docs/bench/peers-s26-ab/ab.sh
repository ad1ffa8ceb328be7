#!/bin/bash
# Workload c, both dtypes, alternating this tree and 06a7845 (git worktree add /tmp/old 06a7845)
cd "$(dirname "$0")/../../.."
for r in 1 2; do
  for v in new old; do
    if [ $v = old ]; then export PYTHONPATH=/tmp/old; else unset PYTHONPATH; fi
    .venv/bin/python -m pdserve.bench.peers run --systems pdserve-fp32,pdserve-bf16 --workloads c --out-dir docs/bench/peers-s26-ab/runs/$v.$r --no-progress > docs/bench/peers-s26-ab/runs/$v.$r.log 2>&1
    echo "$v.$r: $(grep -h 'c SLO attainment' docs/bench/peers-s26-ab/runs/$v.$r/peers.md)"
  done
done
