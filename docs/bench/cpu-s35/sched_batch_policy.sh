#!/bin/bash
# sched_batch_policy.sh GATEWAY_PID DECODE_PID batch|other: every thread of the gateway and the
# decode worker's threads other than the engine's (pdserve-engine) to SCHED_BATCH, or back to
# SCHED_OTHER. Session 35 alternated it under one running `pdserve up` between pairs of
# served_step_decomp.py runs (sched_batch_ab.txt).
G=$1 D=$2
flag=$([ "$3" = batch ] && echo -b || echo -o)
for t in /proc/"$G"/task/*; do chrt "$flag" -p 0 "$(basename "$t")" >/dev/null; done
for t in /proc/"$D"/task/*; do
  [ "$(cat "$t"/comm)" = pdserve-engine ] || chrt "$flag" -p 0 "$(basename "$t")" >/dev/null
done
