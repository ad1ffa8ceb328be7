"""Workload c on a virtual clock: the engine's own Scheduler and BlockPool, step times from a
cost model fitted to the real engine's steps. The VM's speed swings by up to 1.5x within
minutes; here every policy sees the same machine, so policies compare without its noise.

    # 1. the real engine replays c in process; every step's make-up and forward time
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/bench/cpu-s31/sched_sim.py trace \\
        docs/bench/peers-s30/peers.json /tmp/c_trace.json
    # 2. fit step time = f(make-up) to that trace, then replay c per policy on the model
    .venv/bin/python docs/bench/cpu-s31/sched_sim.py sim docs/bench/peers-s30/peers.json \\
        /tmp/c_trace.json fcfs:0 [budget=N ...] [speed=X ...] [burst]

A policy is ORDER:MAX_WAIT_S. main's Scheduler has one order, fcfs (since session 34 one
prompt a step while few wait: pdserve.engine.scheduler); `pack:0` packs every waiting
prompt into a step up to the budget, as it did before. `git apply
docs/bench/cpu-s31/shortest_first.patch` gives it the one tried in session 31
(`shortest:MAX_WAIT_S`: the waiting sequence with the fewest tokens left first, unless the
oldest has waited MAX_WAIT_S). `burst` puts every arrival at 0 (workload a). `speed=X`
divides every step's modelled time by X: how much faster the engine would have to be.

Step features: rows (tokens computed), decode rows, the decodes' context (their attention
reads) and the prefill chunks' attention pairs. Time = a + b * rows + c * decode context +
d * prefill pairs, fitted apart for steps of up to 8 rows (the GGUF blocks' GEMV) and
above (the float32 panels).
"""

import json
import sys
import time

import numpy as np

import pdserve.engine.scheduler as scheduler_module
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.protocol import SamplingParams

SMALL = 8  # rows up to which a decode step streams the GGUF blocks


def requests(peers_json: str) -> list[dict]:
    runs = json.load(open(peers_json))["systems"]["pdserve-fp32"]["workloads"]
    return sorted(runs["c"]["requests"], key=lambda r: r["arrival_s"])


def prompt_ids(r: dict) -> list[int]:
    return [100 + (r["request_id"] * 31 + j * 13) % 5000 for j in range(r["prompt_tokens"])]


def features(scheduled) -> tuple[int, int, int, float]:
    """(rows, decode rows, decode context, prefill attention pairs) of one step, read before
    the step advances its sequences."""
    rows = dec = ctx = 0
    pairs = 0.0
    for s in scheduled:
        k, done = s.num_new_tokens, s.seq.num_computed_tokens
        rows += k
        if k == 1:
            dec += 1
            ctx += done + 1
        else:
            pairs += k * (done + (k + 1) / 2)
    return rows, dec, ctx, pairs


def trace(peers_json: str, out: str) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    pending = requests(peers_json)
    eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", num_threads=2,
                                 show_progress=False, max_model_len=4096,
                                 overlap_scheduling="off"))
    sched = eng.scheduler
    steps = []
    seen: dict = {}
    real_schedule = sched.schedule

    def peek():  # the step's make-up, read as the engine schedules it
        o = real_schedule()
        seen["f"] = features(o.scheduled)
        return o

    sched.schedule = peek
    t0 = time.monotonic()
    i = 0
    while i < len(pending) or eng.has_unfinished():
        now = time.monotonic() - t0
        while i < len(pending) and pending[i]["arrival_s"] <= now:
            r = pending[i]
            eng.add_request(str(r["request_id"]), prompt_ids(r),
                            SamplingParams(max_tokens=r["output_tokens"], temperature=0.0,
                                           ignore_eos=True))
            i += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, pending[i]["arrival_s"] - now))
            continue
        seen.clear()
        s0 = time.perf_counter()
        eng.step()
        if "f" in seen:
            steps.append([*seen["f"], time.perf_counter() - s0])
    json.dump({"num_blocks": eng.pool.num_blocks, "block_size": eng.pool.block_size,
               "budget": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
               "steps": steps}, open(out, "w"))
    print(f"{len(steps)} steps in {time.monotonic() - t0:.1f} s -> {out}")


class CostModel:
    def __init__(self, steps: list[list[float]]) -> None:
        a = np.array(steps, dtype=float)
        self.coef = {}
        for small in (True, False):
            m = a[(a[:, 0] <= SMALL) == small]
            x = np.column_stack([np.ones(len(m)), m[:, 0], m[:, 2], m[:, 3]])
            self.coef[small], *_ = np.linalg.lstsq(x, m[:, 4], rcond=None)
            pred = x @ self.coef[small]
            err = np.abs(pred - m[:, 4]) / m[:, 4]
            print(f"{'<=8 rows' if small else ' >8 rows'}: {len(m)} steps, "
                  f"a {self.coef[small][0] * 1e3:.2f} ms + {self.coef[small][1] * 1e3:.3f} "
                  f"ms/row + {self.coef[small][2] * 1e6:.3f} us/ctx + "
                  f"{self.coef[small][3] * 1e9:.2f} ns/pair; median |err| "
                  f"{np.median(err) * 100:.1f} %; total {pred.sum():.1f} s vs "
                  f"{m[:, 4].sum():.1f} s measured")

    def seconds(self, rows: int, dec: int, ctx: int, pairs: float) -> float:
        c = self.coef[rows <= SMALL]
        return float(c[0] + c[1] * rows + c[2] * ctx + c[3] * pairs)


class VirtualTime:
    """Stands in for the scheduler module's `time`: monotonic() is the simulated clock."""

    def __init__(self, now: list[float]) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now[0]


def simulate(reqs: list[dict], model: CostModel, geometry: dict, order: str, max_wait: float,
             budget: int, speed: float = 1.0) -> dict:
    pool = BlockPool(geometry["num_blocks"], geometry["block_size"])
    policy = () if order in ("fcfs", "pack") else (order, max_wait)  # the patch's arguments
    sched = Scheduler(pool, budget, geometry["max_num_seqs"], *policy)
    if order == "pack":  # every waiting prompt packed into a step, as before session 34
        sched.serial_queue = -1
    now = [0.0]
    scheduler_module.time = VirtualTime(now)  # the scheduler reads the simulated clock
    pending = list(reqs)
    arrival, first, last = {}, {}, {}
    i = 0
    while i < len(pending) or sched.has_work():
        while i < len(pending) and pending[i]["arrival_s"] <= now[0]:
            r = pending[i]
            rid = str(r["request_id"])
            seq = Sequence(rid, prompt_ids(r), SamplingParams(
                max_tokens=r["output_tokens"], temperature=0.0, ignore_eos=True),
                arrival_time=r["arrival_s"])
            arrival[rid] = r["arrival_s"]
            sched.add(seq)
            i += 1
        if not sched.has_work():
            now[0] = pending[i]["arrival_s"]
            continue
        out = sched.schedule()
        if out.empty:
            raise RuntimeError("nothing scheduled with work waiting")
        now[0] += model.seconds(*features(out.scheduled)) / speed
        samplers = [s.seq for s in out.scheduled if s.samples]
        sched.after_step(out.scheduled)
        for seq in samplers:
            seq.output_token_ids.append(7)
            first.setdefault(seq.request_id, now[0])
            last[seq.request_id] = now[0]
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    ttft = {r: first[r] - arrival[r] for r in arrival}
    outputs = {str(r["request_id"]): r["output_tokens"] for r in reqs}
    tpot = {r: (last[r] - first[r]) / max(1, outputs[r] - 1) for r in arrival}
    met = sum(ttft[r] <= 2.0 and tpot[r] <= 0.2 for r in arrival)
    e2e = sorted(last[r] - arrival[r] for r in arrival)
    return {"share": met / len(arrival), "ttft": sorted(ttft.values()), "e2e": e2e,
            "tpot": sorted(tpot.values()), "end": now[0],
            "missed": {r: ("T" if ttft[r] > 2 else ".") + ("P" if tpot[r] > 0.2 else ".")
                       for r in arrival if ttft[r] > 2 or tpot[r] > 0.2}}


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3


if __name__ == "__main__":
    if sys.argv[1] == "trace":
        trace(sys.argv[2], sys.argv[3])
        sys.exit(0)
    reqs = requests(sys.argv[2])
    if "burst" in sys.argv[4:]:  # workload a: the same requests, all at once
        reqs = [dict(r, arrival_s=0.0) for r in reqs]
    tr = json.load(open(sys.argv[3]))
    model = CostModel(tr["steps"])
    budgets = [int(a.split("=")[1]) for a in sys.argv[4:] if a.startswith("budget=")] or [
        tr["budget"]]
    speeds = [float(a.split("=")[1]) for a in sys.argv[4:] if a.startswith("speed=")] or [1.0]
    for b, sp in ((b, sp) for b in budgets for sp in speeds):
        for pol in (a for a in sys.argv[4:] if ":" in a):
            order, wait = pol.split(":")
            r = simulate(reqs, model, tr, order, float(wait), b, sp)
            print(f"budget {b} speed {sp:.2f} {pol:>14}: share {r['share']:.3f}  TTFT p50 "
                  f"{pct(r['ttft'], .5):5.0f} p95 {pct(r['ttft'], .95):5.0f}  TPOT p50 "
                  f"{pct(r['tpot'], .5):4.0f} p95 {pct(r['tpot'], .95):4.0f}  end "
                  f"{r['end']:.1f} s  e2e p50 {pct(r['e2e'], .5) / 1e3:.1f} mean "
                  f"{sum(r['e2e']) / len(r['e2e']):.1f} s  missed "
                  f"T {sum(v[0] == 'T' for v in r['missed'].values())} "
                  f"P {sum(v[1] == 'P' for v in r['missed'].values())}")
