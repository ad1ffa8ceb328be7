"""Time each streamed chunk of N completions (128 random prompt tokens each) through a
served OpenAI endpoint: the first is the TTFT.

    python docs/bench/cpu-s21/ttft_http.py PORT [N] [SEED] [MAX_TOKENS]

Use a new SEED per run: the same prompts again hit the prefix cache.
"""

import http.client
import json
import random
import sys
import time

port = int(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 6
rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 4
for r in range(n):
    ids = [rng.randrange(100, 40000) for _ in range(128)]
    body = json.dumps({"model": "smollm2-135m", "prompt": ids, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port)
    t = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = c.getresponse()
    marks = []
    while True:
        line = resp.fp.readline()
        if not line or b"[DONE]" in line:
            break
        if line.startswith(b"data:"):
            marks.append((time.perf_counter() - t) * 1e3)
    print(r, "chunks at", " ".join(f"{m:.1f}" for m in marks))
    c.close()
