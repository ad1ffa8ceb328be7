"""S greedy streams at once through the OpenAI completions API (SSE), N output tokens each:
    python burst_client.py BASE_URL [N=400] [S=64] [timestamps.json]
prints the mean gap between a stream's chunks; with a path, writes every chunk's arrival time."""
import asyncio
import json
import sys
import time

import aiohttp

N = int(sys.argv[2]) if len(sys.argv) > 2 else 400
S = int(sys.argv[3]) if len(sys.argv) > 3 else 64
url = sys.argv[1]
async def one(s, i, out):
    body = {"model": "smollm2-135m", "prompt": f"Story {i}: the lighthouse keeper " * 12,
            "max_tokens": N, "ignore_eos": True, "temperature": 0, "stream": True}
    ts = []
    async with s.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                ts.append(time.time())
    out.append(ts)
async def main():
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s, i, out) for i in range(S)))
        el = time.perf_counter() - t0
    chunks = sum(len(t) for t in out)
    tp = [(t[-1]-t[0])/(len(t)-1) for t in out if len(t) > 1]
    json.dump(out, open(sys.argv[4], "w")) if len(sys.argv) > 4 else None
    print(f"{S} streams, {chunks} chunks in {el:.1f}s; mean chunk gap {1e3*sum(tp)/len(tp):.1f} ms")
asyncio.run(main())
