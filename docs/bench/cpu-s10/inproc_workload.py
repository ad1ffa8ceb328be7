"""Peers workload a in this process, as one burst per round: the engine's wall time, its
steps, and the seconds of its steps and forwards (the same sums a served worker exports as
pdserve:engine_step_seconds_total / engine_forward_seconds_total), plus the per-thread CPU
(session 10, docs/benchmarks.md section 6).

    SEEDS=0,1,0 python docs/bench/cpu-s10/inproc_workload.py bfloat16 3

A round that repeats an earlier round's seed finds its prompts in the prefix cache.
"""
import os
import subprocess
import sys
import time

from pdserve.bench.peers_workloads import WORKLOADS
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
THREADS = os.path.join(HERE, "..", "cpu-s9")


def thread_snapshot(path: str) -> None:
    subprocess.run([sys.executable, os.path.join(THREADS, "threads.py"), str(os.getpid()), path])


dt = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
seeds = [int(x) for x in os.environ.get("SEEDS", "0,0,0").split(",")]
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dt, num_threads=2, show_progress=False))
for rnd in range(rounds):
    reqs = WORKLOADS["a"].requests(eng.tokenizer, seeds[rnd])
    thread_snapshot("/tmp/threads0.json")
    eng.trace = []
    t0 = time.perf_counter()
    out = 0
    for r in reqs:
        eng.add_request(f"{rnd}-{r.request_id}", r.prompt, SamplingParams(
            max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        out += sum(len(d.new_token_ids) for d in eng.step())
    el = time.perf_counter() - t0
    thread_snapshot("/tmp/threads1.json")
    subprocess.run([sys.executable, os.path.join(THREADS, "threads_diff.py"),
                    "/tmp/threads0.json", "/tmp/threads1.json"])
    tr, eng.trace = eng.trace, None
    print(f"round {rnd} seed {seeds[rnd]} {dt}: {el:.2f} s, {out / el:.1f} out tok/s, "
          f"{len(tr)} steps, steps {sum(t.total_seconds for t in tr):.2f} s, "
          f"forwards {sum(t.forward_seconds for t in tr):.2f} s", flush=True)
