"""CPU time per streamed token of each thread of a running `pdserve up`: one 256-token
completion through the OpenAI API, /proc/<pid>/task/*/stat read before and after.

    python docs/bench/cpu-s6/served_thread_cpu.py GATEWAY_PID DECODE_PID HTTP_PORT
"""

import json
import os
import sys
import time
import urllib.request

TOKENS = 256


def thread_cpu(pid: int) -> dict[str, float]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main() -> None:
    pids = {"gateway": int(sys.argv[1]), "decode": int(sys.argv[2])}
    before = {k: thread_cpu(p) for k, p in pids.items()}
    body = json.dumps({"model": "smollm2-135m", "prompt": "Tell me a long story. " * 10,
                       "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[3]}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    with urllib.request.urlopen(req) as r:  # noqa: S310 - loopback
        r.read()  # the whole SSE stream: the timing ends with its last event
    wall = time.time() - t0
    print(f"{1000 * wall / TOKENS:.1f} ms per token")
    for k, pid in pids.items():
        after = thread_cpu(pid)
        per = {t: round(1000 * (v - before[k].get(t, 0.0)) / TOKENS, 2) for t, v in after.items()}
        busy = {t: v for t, v in sorted(per.items(), key=lambda x: -x[1]) if v > 0}
        print(f"{k}: {sum(busy.values()):.2f} ms CPU per token {busy}")


if __name__ == "__main__":
    main()
