#!/bin/bash
# One long greedy stream through `pdserve up --dtype bfloat16 --quantization int8`, with
# py-spy (pip install py-spy) sampling every process of the cluster for 10 s at 200 Hz;
# prints, per process, the samples (busy time: py-spy leaves idle threads out) by thread
# and by function. usage, from the repository root:
#   docs/bench/cpu-s11/profile_one_stream.sh [more pdserve up args]
out=$(mktemp -d)
.venv/bin/python -m pdserve.cli up --dtype bfloat16 --quantization int8 --http-port 18080 \
    "$@" > "$out/up.log" 2>&1 &
pid=$!
for i in $(seq 120); do curl -sf localhost:18080/health >/dev/null && break; sleep 1; done
curl -sN localhost:18080/v1/completions -H 'content-type: application/json' \
    -d '{"model":"smollm2-135m","prompt":"Write a long story about a lighthouse keeper.",
         "max_tokens":1500,"ignore_eos":true,"temperature":0,"stream":true}' > "$out/sse" &
client=$!
sleep 3
for k in $(pgrep -P $pid); do
    .venv/bin/py-spy record -p "$k" -d 10 -r 200 -f raw -o "$out/$k.raw" --nonblocking \
        >/dev/null 2>&1 &
done
sleep 12
kill $client $pid; wait $pid 2>/dev/null
echo "$(grep -c '^data:' "$out/sse") chunks streamed"
for f in "$out"/*.raw; do
    k=$(basename "$f" .raw)
    echo "== $(grep -m1 "pid $k\|$k" "$out/up.log" | cut -c1-60) (pid $k)"
    python3 - "$f" <<'PY'
import collections, sys
by_thread, by_self, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    frames, n = stack.split(";"), int(n)
    total += n
    by_thread[frames[0][:70]] += n
    by_self[frames[-1][:100]] += n
print(f"{total} samples")
for what, counts in (("thread", by_thread), ("self", by_self)):
    for name, n in counts.most_common(8):
        print(f"  {what} {n:6d} {name}")
PY
done
rm -rf "$out"
