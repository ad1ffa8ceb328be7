#!/bin/bash
# One greedy float32 stream through pdserve up: the interpreter's switch interval 5 ms
# (default) against 0.2 ms in every process (a sitecustomize on PYTHONPATH), alternated.
cd /work/main
for r in 1 2 3; do
  for iv in default 0.0002; do
    echo "== $iv round $r"
    if [ $iv = default ]; then
      PYTHONPATH=docs/bench/cpu-s24 (switch_sitecustomize.py copied there as sitecustomize.py) .venv/bin/python -m pdserve.bench.served_overhead --dtype float32 --streams ${STREAMS:-1} --rounds 1 2>&1 | grep -E "^streams|CPU us"
    else
      PDS_SWITCH_INTERVAL=$iv PYTHONPATH=docs/bench/cpu-s24 (switch_sitecustomize.py copied there as sitecustomize.py) .venv/bin/python -m pdserve.bench.served_overhead --dtype float32 --streams ${STREAMS:-1} --rounds 1 2>&1 | grep -E "^streams|CPU us"
    fi
  done
done
