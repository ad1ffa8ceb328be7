"""Per-thread CPU seconds and context switches of a process, as JSON.

    python threads.py PID OUT
"""
import json
import os
import sys

pid = sys.argv[1]
out = {}
for tid in os.listdir(f"/proc/{pid}/task"):
    try:
        st = open(f"/proc/{pid}/task/{tid}/stat").read()
        status = open(f"/proc/{pid}/task/{tid}/status").read()
    except OSError:
        continue
    fields = st.rsplit(")", 1)[1].split()
    info = dict(line.split(":\t") for line in status.strip().split("\n") if ":\t" in line)
    out[tid] = [st[st.index("(") + 1:st.rindex(")")],
                (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"),
                int(info["voluntary_ctxt_switches"]), int(info["nonvoluntary_ctxt_switches"])]
json.dump(out, open(sys.argv[2], "w"))
