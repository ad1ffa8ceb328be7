#!/bin/sh
# c (Poisson 2 req/s), float32, the step budget alternated
cd "$(git rev-parse --show-toplevel)"
for r in 1 2 3 4; do
  for b in 2048 256 512; do
    .venv/bin/python -m pdserve.bench.peers run --systems pdserve-fp32 --workloads c \
      --out-dir docs/bench/peers-s25-budget/b${b}_r$r --pdserve-args "--max-num-batched-tokens $b" --no-progress >/dev/null 2>&1
    python3 -c "
import json;d=json.load(open('docs/bench/peers-s25-budget/b${b}_r$r/peers.json'));r=d['systems']['pdserve-fp32']['workloads']['c']['report']
print('round $r budget $b slo %.3f ttft p50/p95 %.0f/%.0f tpot p50/p95 %.0f/%.0f failed %d' % (r['slo_attainment'], r['ttft_ms']['p50'], r['ttft_ms']['p95'], r['tpot_ms']['p50'], r['tpot_ms']['p95'], r['failed']))"
  done
done
