"""The difference of two threads.py snapshots, busiest thread first.

    python threads_diff.py BEFORE AFTER
"""
import json
import sys

a = json.load(open(sys.argv[1]))
b = json.load(open(sys.argv[2]))
for tid, (comm, cpu, vol, inv) in sorted(b.items(), key=lambda x: -x[1][1]):
    c0, v0, i0 = a[tid][1:] if tid in a else (0, 0, 0)
    if cpu - c0 > 0.05:
        print(f"{comm:20s} {tid:>7s} cpu {cpu - c0:7.2f}s vol {vol - v0:8d} invol {inv - i0:7d}")
