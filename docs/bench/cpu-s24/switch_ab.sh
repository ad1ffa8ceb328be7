#!/bin/bash
# The tiers' GIL switch interval through the API, alternated: CPython's 5 ms
# (PDSERVE_SWITCH_INTERVAL=0.005) against 0.2 ms, pdserve.event_loop's default at a541ac1
# (run there; the variable was reverted after this). STREAMS (default 1), DTYPE, ROUNDS.
cd "$(dirname "$0")/../../.."
for r in $(seq "${ROUNDS:-3}"); do
  for iv in 0.005 default; do
    echo "== switch interval $iv, round $r"
    if [ $iv = default ]; then unset PDSERVE_SWITCH_INTERVAL; else export PDSERVE_SWITCH_INTERVAL=$iv; fi
    .venv/bin/python -m pdserve.bench.served_overhead --dtype "${DTYPE:-float32}" \
      --streams "${STREAMS:-1}" --rounds 1 2>&1 | grep -E "^streams +[0-9]+ round|CPU us"
  done
done
