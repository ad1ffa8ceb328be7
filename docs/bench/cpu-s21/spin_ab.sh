# Through the API, alternated: the shared-core workers under OMP_WAIT_POLICY=PASSIVE alone
# ("base"; at the time what `pdserve up` set) and with GOMP_SPINCOUNT=10000 ("spin").
# Rounds 1-2 ran `--systems pdserve-bf16,pdserve-fp32 --workloads a,c,d`, rounds 3-4
# `--systems pdserve-fp32,pdserve-bf16 --workloads a,c`.
cd "$(dirname "$0")/../../.."
for r in 1 2; do
  for cfg in base spin; do
    if [ $cfg = spin ]; then export GOMP_SPINCOUNT=10000; else unset GOMP_SPINCOUNT; fi
    .venv/bin/python -m pdserve.bench.peers run --systems pdserve-bf16,pdserve-fp32 \
      --workloads a,c,d --out-dir /tmp/s21/ab-$cfg-$r --no-progress
  done
done
