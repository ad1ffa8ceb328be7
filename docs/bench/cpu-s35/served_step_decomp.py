"""One 512-token greedy stream at a time through a running `pdserve up` (HTTP on :18000, the
decode worker's metrics on :18004): the client's TPOT beside the engine's own step and
forward time over the same steps (`engine_step_seconds_total`, `engine_forward_seconds_total`
and `engine_steps_total` from the worker's /metrics, read before and after).

    python docs/bench/cpu-s35/served_step_decomp.py ROUNDS

With `--in-process`, the same streams in an engine in this process (float32, two threads;
run it under `OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 taskset -c 0,1`, as the worker
runs), read from the same counters.
"""

import json
import re
import sys
import time
import urllib.request

HTTP, METRICS = "http://127.0.0.1:18000", "http://127.0.0.1:18004/metrics"


def engine_counters() -> tuple[float, float, float]:
    text = urllib.request.urlopen(METRICS).read().decode()

    def value(name: str) -> float:
        return float(re.search(r"^pdserve:%s\{[^}]*\} (\S+)" % name, text, re.M).group(1))

    return (value("engine_steps_total"), value("engine_step_seconds_total"),
            value("engine_forward_seconds_total"))


def stream_tpot(tokens: int) -> float:
    body = json.dumps({"model": "smollm2-135m", "prompt": "Once upon a time",
                       "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{HTTP}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    arrivals = []
    with urllib.request.urlopen(req) as r:
        for line in r:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


def in_process(rounds: int) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.protocol import SamplingParams

    eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", num_threads=2,
                                 show_progress=False))
    prompt = eng.tokenizer.encode("Once upon a time")
    c = eng.counters
    for r in range(rounds):
        eng.add_request(f"r{r}", prompt, SamplingParams(max_tokens=512, temperature=0.0,
                                                        ignore_eos=True))
        s0, f0, n0 = c.step_seconds, c.forward_seconds, c.steps
        while eng.has_unfinished():
            eng.step()
        n = c.steps - n0
        print(f"in process: step {1e3 * (c.step_seconds - s0) / n:.2f}  forward "
              f"{1e3 * (c.forward_seconds - f0) / n:.2f}  (steps {n})", flush=True)


def main() -> None:
    if "--in-process" in sys.argv:
        in_process(int(sys.argv[1]))
        return
    for _ in range(int(sys.argv[1])):
        a = engine_counters()
        tpot = stream_tpot(512)
        b = engine_counters()
        steps = b[0] - a[0]
        print(f"tpot {1e3 * tpot:.2f} ms  step {1e3 * (b[1] - a[1]) / steps:.2f}  "
              f"forward {1e3 * (b[2] - a[2]) / steps:.2f}  (steps {steps:.0f})", flush=True)


if __name__ == "__main__":
    main()
