"""One prepared GPU check: compile and measure the Triton kernels and the engine, write one
JSON report. Called by scripts/gpu_check.sh; `--dry-run` proves imports and code paths on a
CPU (kernels under the interpreter, tiny shapes, nothing heavy).

Sections run in order, each in its own process group with its own time box inside an
overall budget, and each writes its result as it goes, so a crash, a hang or a timeout in
one keeps what it measured and loses nothing of the others. The report is rewritten after
every section. A dry run, which measures nothing, runs decode_step and e2e beside the other
sections (two lanes); the report keeps the order below either way.

    env                 device, versions, peak bandwidth / bf16 TFLOP/s by device name
    kernel_tests        tests/test_kernels.py, test_kernels_fused.py, test_triton_backend.py,
                        compiled
    decode_bandwidth    paged decode GB/s (split-K heuristic and its choice, forced on,
                        forced off; small tile sweeps) beside SDPA on contiguous K/V
    prefill_tflops      varlen prefill TFLOP/s (block_m/block_n/warps/stages sweep, the
                        default config recorded) beside causal SDPA
    fused_ops           residual add + RMSNorm and RoPE: the Triton kernels vs llama.py's
                        eager torch (and torch.compile of it), us / GB/s / speedup / error,
                        at SmolLM2 and Llama-8B shapes: do the kernels pay for wiring in?
    engine_throughput   SmolLM2 generate() tokens/s with the triton backend (+ a greedy
                        parity glance against the torch backend)
    decode_step         steady decode step at batch 64 / 1, GPU busy share and D2H copies
                        per step (profiler), graph capture time / memory, greedy parity
                        graphs vs --enforce-eager (scripts/gpu_check_serving.py)
    e2e                 `pdserve up --device cuda` colocated and 1 prefill + 1 decode,
                        loadgen mixed-64 and 64 x 1024/128 (scripts/gpu_check_serving.py)

The report ends with `verdict`: PASS / FAIL / MISSING per target of issue 11's table, also
printed one line each.

`--only a,b` runs just those sections (in the order above).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_serving as serving  # noqa: E402 - the sibling module, found through sys.path

ROOT = Path(__file__).resolve().parent.parent
TOTAL_BUDGET_S = 460  # under the 8 minutes asked for, leaving room for setup
SECTIONS = {  # name -> time box in seconds
    "env": 40,
    "kernel_tests": 170,
    "decode_bandwidth": 100,
    "prefill_tflops": 150,  # ~20 sweep configs, each a compile
    "fused_ops": 75,  # ~45 s expected; torch.compile stops being tried past FUSED_COMPILE_S
    "engine_throughput": 90,
    "decode_step": 120,
    "e2e": 230,
}
# A dry run's second lane (see main): the serving sections, in this order (e2e reuses the
# model decode_step makes, so they share a lane).
DRY_RUN_LANE2 = ("decode_step", "e2e")
# (peak HBM bytes/s, dense bf16 FLOP/s) by a substring of torch's device name; first match.
PEAKS = [
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # SXM
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100", 1.555e12, 312e12),
]


# ---------------------------------------------------------------- process plumbing


def run_boxed(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[int | None, str]:
    """Run cmd in its own process group; on timeout kill the whole group (rc None)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # grandchildren too (pytest, compilers)
        out, _ = proc.communicate()
        return None, out


def child_env(dry_run: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    if dry_run:
        env["TRITON_INTERPRET"] = "1"  # no GPU: kernels run tiny under the interpreter
    else:
        # "0", not unset: the test modules setdefault it to "1" for CPU runs.
        env["TRITON_INTERPRET"] = "0"  # the point is to compile them
    return env


class Result(dict):
    """A section's result, saved to disk after every measurement."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=1, default=str))
        tmp.replace(self.path)


def guarded(res: Result, key: str, fn, *args, **kwargs) -> None:
    """res[key] = fn(...), or the error; one failed point does not end the section."""
    try:
        res[key] = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the report is the place for any failure
        res[key] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    res.save()


# ---------------------------------------------------------------- measuring


def _timer(device: str):
    """ms per call: triton's do_bench on a GPU (median), one timed call on the CPU."""
    if device == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    def once(fn) -> float:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return once


def _peaks() -> tuple[str, float | None, float | None]:
    import torch

    if not torch.cuda.is_available():
        return "cpu", None, None
    name = torch.cuda.get_device_name()
    for key, bw, flops in PEAKS:
        if key in name:
            return name, bw, flops
    return name, None, None


def _paged_cache(batch: int, ctx: int, hkv: int, d: int, bs: int, dtype, device: str):
    import torch

    per_seq = math.ceil(ctx / bs)
    num_blocks = batch * per_seq + 1
    k = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    # Shuffled block ids: a serving cache is never laid out in order.
    ids = torch.randperm(num_blocks, device=device)[:batch * per_seq].int()
    return k, v, ids.view(batch, per_seq).contiguous()


def _sdpa(q, k, v, causal: bool):
    import torch.nn.functional as F

    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except (TypeError, RuntimeError):  # older torch: no enable_gqa
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=causal)


def decode_point(device: str, dtype, batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int,
                 peak_bw: float | None, sweep: list[dict] | None, **launch) -> dict:
    import torch

    from pdserve.engine.kernels.paged_decode_attention import (
        DEFAULT_PARTITION_SIZE,
        device_sm_count,
        paged_decode_attention,
        use_split_k,
    )

    time_ms = _timer(device)
    k, v, tables = _paged_cache(batch, ctx, hkv, d, bs, dtype, device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, dtype=dtype, device=device)
    nbytes = 2 * batch * ctx * hkv * d * k.element_size() + 2 * q.numel() * q.element_size()

    def gbps(ms: float) -> dict:
        r = {"us": round(ms * 1e3, 2), "GBps": round(nbytes / ms / 1e6, 1)}
        if peak_bw:
            r["pct_peak"] = round(100 * nbytes / (ms * 1e-3) / peak_bw, 1)
        return r

    def run(split_k, **kw):
        args = {**launch, **kw}
        return lambda: paged_decode_attention(
            query=q, k_cache=k, v_cache=v, seq_lens=lens, block_tables=tables, scale=d ** -0.5,
            max_seq_len=ctx, split_k=split_k, validate=False, **args)

    heuristic_split = use_split_k(
        batch_size=batch, num_kv_heads=hkv, max_seq_len=ctx, num_sms=device_sm_count(q.device),
        partition_size=launch.get("partition_size", DEFAULT_PARTITION_SIZE))
    out = {"batch": batch, "context": ctx, "heads": [hq, hkv, d], "block_size": bs,
           "bytes": nbytes, "heuristic_split": heuristic_split,
           "triton_heuristic": gbps(time_ms(run(None))),
           "triton_split": gbps(time_ms(run(True))),
           "triton_nosplit": gbps(time_ms(run(False)))}
    # SDPA on the same K/V made contiguous [B, Hkv, ctx, D] (no paging).
    kc = k[tables.long()].reshape(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    vc = v[tables.long()].reshape(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    out["sdpa"] = gbps(time_ms(lambda: _sdpa(q.unsqueeze(2), kc, vc, causal=False)))
    ref = _sdpa(q.unsqueeze(2).float(), kc.float(), vc.float(), causal=False)[:, :, 0]
    out["max_abs_err_vs_fp32_sdpa"] = float((run(None)().float() - ref).abs().max())
    for cfg in sweep or []:
        key = "sweep_" + "_".join(f"{a}{b}" for a, b in cfg.items())
        try:
            out[key] = gbps(time_ms(run(cfg.pop("split_k", False), **cfg)))
        except Exception as e:  # noqa: BLE001 - an unsupported config is a data point
            out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def prefill_point(device: str, dtype, chunks: list[tuple[int, int]], hq: int, hkv: int, d: int,
                  bs: int, peak_flops: float | None, sweep: list[dict] | None, **launch) -> dict:
    """chunks: (query_len, seq_len) per sequence; SDPA only where there is no prefix."""
    import torch

    from pdserve.engine.kernels.prefill_attention import (
        DEFAULT_BLOCK_M,
        DEFAULT_BLOCK_N,
        DEFAULT_NUM_STAGES,
        default_num_warps,
        prefill_attention,
    )

    time_ms = _timer(device)
    batch, max_ctx = len(chunks), max(s for _, s in chunks)
    k, v, tables = _paged_cache(batch, max_ctx, hkv, d, bs, dtype, device)
    cu = [0]
    for q_len, _ in chunks:
        cu.append(cu[-1] + q_len)
    q = torch.randn(cu[-1], hq, d, dtype=dtype, device=device)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    lens = torch.tensor([s for _, s in chunks], dtype=torch.int32, device=device)
    # 2 matmuls x 2 flop per multiply-add x keys seen by each query (causal incl. prefix).
    pairs = sum(sum(range(s - ql + 1, s + 1)) for ql, s in chunks)
    flops = 4 * pairs * hq * d

    def tflops(ms: float) -> dict:
        r = {"us": round(ms * 1e3, 1), "TFLOPs": round(flops / ms / 1e9, 1)}
        if peak_flops:
            r["pct_peak"] = round(100 * flops / (ms * 1e-3) / peak_flops, 1)
        return r

    def run(**kw):
        args = {**launch, **kw}
        return lambda: prefill_attention(
            query=q, k_cache=k, v_cache=v, cu_seqlens=cu_t, seq_lens=lens, block_tables=tables,
            scale=d ** -0.5, max_query_len=max(ql for ql, _ in chunks), validate=False, **args)

    block_m = launch.get("block_m", DEFAULT_BLOCK_M)
    config = {"block_m": block_m, "block_n": launch.get("block_n", DEFAULT_BLOCK_N),
              "num_warps": launch.get("num_warps") or default_num_warps(block_m, d),
              "num_stages": launch.get("num_stages", DEFAULT_NUM_STAGES)}
    out = {"chunks": chunks, "heads": [hq, hkv, d], "block_size": bs, "flops": flops,
           "config": config, "triton": tflops(time_ms(run()))}
    if all(ql == s for ql, s in chunks) and len({s for _, s in chunks}) == 1:
        length = chunks[0][0]
        qs = q.view(batch, length, hq, d).transpose(1, 2)
        kc = k[tables.long()].reshape(batch, -1, hkv, d)[:, :length].transpose(1, 2).contiguous()
        vc = v[tables.long()].reshape(batch, -1, hkv, d)[:, :length].transpose(1, 2).contiguous()
        out["sdpa_causal"] = tflops(time_ms(lambda: _sdpa(qs, kc, vc, causal=True)))
    for cfg in sweep or []:
        key = "sweep_" + "_".join(f"{a}{b}" for a, b in cfg.items())
        try:
            out[key] = tflops(time_ms(run(**cfg)))
        except Exception as e:  # noqa: BLE001 - an unsupported config is a data point
            out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


# ---------------------------------------------------------------- sections


def section_env(res: Result, dry_run: bool) -> None:
    import torch

    res["python"] = sys.version.split()[0]
    res["torch"] = torch.__version__
    res["cuda_available"] = torch.cuda.is_available()
    res["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError as e:
        res["triton"] = f"missing: {e}"
    name, bw, flops = _peaks()
    res.update(device=name, peak_bandwidth_Bps=bw, peak_bf16_flops=flops)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        res.update(sms=p.multi_processor_count, memory_GiB=round(p.total_memory / 2**30, 1),
                   capability=f"{p.major}.{p.minor}")
    # Proves the kernel modules and the backend import (and register) here.
    from pdserve.engine.kernels.common import interpreted
    from pdserve.engine.layers.registry import available_backends

    res["backends"] = available_backends()
    res["kernels_interpreted"] = interpreted()
    res.save()


def section_kernel_tests(res: Result, dry_run: bool) -> None:
    files = ["tests/test_kernels.py", "tests/test_kernels_fused.py",
             "tests/test_triton_backend.py"]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
               f"--junitxml={xml}"]
        if dry_run:
            cmd.append("--collect-only")
        t0 = time.time()
        # The parent's box covers this; the child gets a little less so it can report.
        rc, out = run_boxed(cmd, timeout=_BOX["s"] - 15, env=dict(os.environ))
        res.update(returncode=rc, wall_s=round(time.time() - t0, 1), tail=out[-3000:])
        if rc is None:
            res["error"] = "pytest timed out"
        if xml.exists():
            root = ET.parse(xml).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] \
                - counts["skipped"]
            res["counts"] = counts
            res["failed"] = [
                {"test": f"{c.get('classname')}::{c.get('name')}",
                 "message": (c[0].get("message") or "")[:400]}
                for c in suite.iter("testcase") if len(c) and c[0].tag in ("failure", "error")]
        if dry_run:
            res["collected"] = out.count("::")
    res.save()


def section_decode_bandwidth(res: Result, dry_run: bool) -> None:
    import torch

    _, bw, _ = _peaks()
    if dry_run:
        guarded(res, "b2_ctx40", decode_point, "cpu", torch.float32, 2, 40, 4, 2, 64, 16, bw,
                [{"tile_n": 32}], partition_size=32, tile_n=16)
        return
    dt = torch.bfloat16
    # Llama-3-8B-like GQA (32 query / 8 kv heads, head_dim 128), block size 16.
    main = {"hq": 32, "hkv": 8, "d": 128, "bs": 16}
    sweep = [{"tile_n": t, "num_warps": w} for t in (32, 64, 128) for w in (4, 8)]
    guarded(res, "b64_ctx2048", decode_point, "cuda", dt, 64, 2048, peak_bw=bw, sweep=sweep,
            **main)
    for b, ctx in ((1, 8192), (8, 4096), (32, 1024), (128, 2048), (256, 512)):
        guarded(res, f"b{b}_ctx{ctx}", decode_point, "cuda", dt, b, ctx, peak_bw=bw,
                sweep=None, **main)
    # SmolLM2-135M's own shape (9 query / 3 kv heads, head_dim 64): 128-byte K/V rows, so
    # longer tiles carry as many bytes per iteration as the head_dim 128 shape's.
    small_sweep = [{"tile_n": t, "num_warps": w} for t, w in ((128, 4), (128, 8), (256, 8))] \
        + [{"split_k": True, "tile_n": t, "num_warps": 4} for t in (64, 128)]
    guarded(res, "smollm2_b64_ctx2048", decode_point, "cuda", dt, 64, 2048, 9, 3, 64, 16, bw,
            small_sweep)


def section_prefill_tflops(res: Result, dry_run: bool) -> None:
    import torch

    _, _, flops = _peaks()
    if dry_run:
        guarded(res, "2x24", prefill_point, "cpu", torch.float32, [(24, 24), (24, 24)], 4, 2, 64,
                16, flops, [{"block_m": 32, "block_n": 16}], block_m=16, block_n=16)
        guarded(res, "prefix", prefill_point, "cpu", torch.float32, [(8, 40)], 4, 2, 64, 16,
                flops, None, block_m=16, block_n=16)
        return
    dt = torch.bfloat16
    main = {"hq": 32, "hkv": 8, "d": 128, "bs": 16}
    # block_m counts query-tile rows: positions x the GROUP heads of one KV head (GQA
    # packing), so 128 rows are 32 positions of 4 heads here, 42 of 3 for SmolLM2.
    # The default (config in each point) is 128 x 64, 8 warps, 3 stages for head_dim 128.
    sweep = [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
             for m, n, w, s in ((128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2),
                                (128, 128, 8, 3), (128, 32, 8, 3), (64, 64, 4, 2),
                                (64, 64, 4, 3), (64, 128, 4, 3), (256, 64, 8, 2),
                                (128, 64, 4, 3))]
    guarded(res, "4x2048", prefill_point, "cuda", dt, [(2048, 2048)] * 4, peak_flops=flops,
            sweep=sweep, **main)
    guarded(res, "1x8192", prefill_point, "cuda", dt, [(8192, 8192)], peak_flops=flops,
            sweep=None, **main)
    guarded(res, "16x512", prefill_point, "cuda", dt, [(512, 512)] * 16, peak_flops=flops,
            sweep=None, **main)
    guarded(res, "chunk2048_on_prefix6144", prefill_point, "cuda", dt, [(2048, 8192)],
            peak_flops=flops, sweep=None, **main)
    small_sweep = [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
                   for m, n, w, s in ((128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 4, 3),
                                      (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3),
                                      (256, 64, 8, 3))]
    guarded(res, "smollm2_4x2048", prefill_point, "cuda", dt, [(2048, 2048)] * 4, 9, 3, 64, 16,
            flops, small_sweep)


# torch.compile is tried only while fused_ops is younger than this: a first inductor compile
# can take tens of seconds on a fresh machine, and the section must stay under a minute.
FUSED_COMPILE_S = 30.0


def _bandwidth(nbytes: int, ms: float, peak_bw: float | None) -> dict:
    r = {"us": round(ms * 1e3, 2), "GBps": round(nbytes / ms / 1e6, 1)}
    if peak_bw:
        r["pct_peak"] = round(100 * nbytes / (ms * 1e-3) / peak_bw, 1)
    return r


def _fused_case(kind: str, device: str, dtype, t: int, shape: dict) -> dict:
    """One fused-op measurement's inputs: the eager function (llama.py's math, as a function
    of tensors so torch.compile can take it), the kernel call, their error, useful bytes.

    kind: "add_rms_norm" (x = x + out; h = rms_norm(x)), "rms_norm" (no add) or "rope".
    Bytes count what the fused op must move (each input read once, each output written
    once), the same for all three variants, so GB/s compares them like-for-like.
    """
    import torch

    from pdserve.engine.kernels.rms_norm import (
        add_rms_norm,
        add_rms_norm_reference,
        rows_per_program,
    )
    from pdserve.engine.kernels.rotary import rope_reference, rotary_embedding, rotary_reference
    from pdserve.engine.layers.norm import rms_norm

    torch.manual_seed(0)
    es = torch.empty((), dtype=dtype).element_size()
    if kind in ("add_rms_norm", "rms_norm"):
        h, eps, residual = shape["h"], 1e-5, kind == "add_rms_norm"
        x = torch.randn(t, h, dtype=dtype, device=device)
        r = torch.randn(t, h, dtype=dtype, device=device)
        w = (1 + 0.1 * torch.randn(h, device=device)).to(dtype)
        r_kernel = r.clone()
        y = add_rms_norm(x=x, weight=w, eps=eps, residual=r_kernel if residual else None)
        ref_y, ref_r = add_rms_norm_reference(x, w, eps, r if residual else None)
        err = {"max_abs_err": float((y.float() - ref_y.float()).abs().max()),
               "exact_fraction": round(float((y == ref_y).float().mean()), 4)}
        if residual:
            err["residual_max_abs_err"] = float((r_kernel.float() - ref_r.float()).abs().max())
        # The timed kernel adds into its residual thousands of times; a small x keeps that
        # sum far from fp16's range (values do not change the time).
        xt = x * 1e-3

        if residual:
            def eager(x_, r_, w_):
                s = r_ + x_
                return s, rms_norm(s, w_, eps)
        else:
            def eager(x_, r_, w_):
                return rms_norm(x_, w_, eps)

        def kernel(**kw):
            return lambda: add_rms_norm(x=xt, weight=w, eps=eps,
                                        residual=r_kernel if residual else None, **kw)

        return {"bytes": ((4 if residual else 2) * t * h + h) * es, "eager": eager,
                "args": (xt, r, w), "kernel": kernel, "error": err,
                "launch": {"rows": rows_per_program(t, h)}}
    if kind != "rope":
        raise ValueError(kind)
    hq, hkv, d, max_position = shape["hq"], shape["hkv"], shape["d"], 8192
    n = hq + hkv
    qkv = torch.randn(t, (n + hkv) * d, dtype=dtype, device=device)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=device).float() / d)
    freqs = torch.outer(torch.arange(max_position, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.randint(0, max_position, (t,), device=device)
    q_kernel = qkv.clone()
    rotary_embedding(qkv=q_kernel, cos=cos, sin=sin, positions=positions, num_q_heads=hq,
                     num_kv_heads=hkv, head_dim=d)
    ref = rotary_reference(qkv, cos, sin, positions, hq, hkv, d)
    err = {"max_abs_err": float((q_kernel.float() - ref.float()).abs().max()),
           "exact_fraction": round(float((q_kernel == ref).float().mean()), 4),
           "v_untouched": bool(torch.equal(q_kernel[:, n * d:], qkv[:, n * d:]))}

    # llama.py gathers cos/sin once per forward and runs this per layer: timed per layer.
    def eager(qkv_, c_, s_):
        return rope_reference(qkv_[:, :n * d].view(t, n, d), c_, s_)

    def kernel(**kw):
        # In place, call after call: a rotation keeps the values' scale.
        return lambda: rotary_embedding(qkv=q_kernel, cos=cos, sin=sin, positions=positions,
                                        num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                        validate=False, **kw)

    return {"bytes": (2 * t * n * d + 2 * t * d) * es, "eager": eager,
            "args": (qkv, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)),
            "kernel": kernel, "error": err, "launch": {}}


def fused_point(kind: str, device: str, dtype, t: int, shape: dict, peak_bw: float | None,
                sweep: list[dict] | None) -> dict:
    """Eager vs the Triton kernel (torch.compile is added by a later pass, budget allowing)."""
    time_ms = _timer(device)
    case = _fused_case(kind, device, dtype, t, shape)
    nbytes, args = case["bytes"], case["args"]
    out = {"T": t, "shape": shape, "dtype": str(dtype).replace("torch.", ""), "bytes": nbytes,
           **case["error"], **case["launch"],
           "eager": _bandwidth(nbytes, time_ms(lambda: case["eager"](*args)), peak_bw),
           "triton": _bandwidth(nbytes, time_ms(case["kernel"]()), peak_bw)}
    out["speedup_vs_eager"] = round(out["eager"]["us"] / out["triton"]["us"], 2)
    for cfg in sweep or []:
        key = "sweep_" + "_".join(f"{a}{b}" for a, b in cfg.items())
        try:
            out[key] = _bandwidth(nbytes, time_ms(case["kernel"](**cfg)), peak_bw)
        except Exception as e:  # noqa: BLE001 - an unsupported config is a data point
            out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def fused_compiled(kind: str, device: str, dtype, t: int, shape: dict,
                   peak_bw: float | None, backend: str = "inductor") -> dict:
    """torch.compile of the same eager function: what the kernels must beat to pay."""
    import torch

    time_ms = _timer(device)
    case = _fused_case(kind, device, dtype, t, shape)
    fn = torch.compile(case["eager"], dynamic=False, backend=backend)
    t0 = time.perf_counter()
    fn(*case["args"])
    if device == "cuda":
        torch.cuda.synchronize()
    compile_s = round(time.perf_counter() - t0, 1)
    return {**_bandwidth(case["bytes"], time_ms(lambda: fn(*case["args"])), peak_bw),
            "compile_s": compile_s, "backend": backend}


def section_fused_ops(res: Result, dry_run: bool) -> None:
    import torch

    t_start = time.time()
    _, bw, _ = _peaks()
    if dry_run:  # the interpreter: one tiny point per op, torch.compile without inductor
        device, dtypes, lengths = "cpu", [torch.float32], [4]
        shapes = {"tiny": {"h": 64, "hq": 4, "hkv": 2, "d": 16}}
    else:
        device, dtypes, lengths = "cuda", [torch.bfloat16, torch.float16], [64, 4096]
        shapes = {"smollm2": {"h": 576, "hq": 9, "hkv": 3, "d": 64},
                  "llama8b": {"h": 4096, "hq": 32, "hkv": 8, "d": 128}}
    # Launch-parameter sweeps at the prefill length, bf16: what to retune if wiring in.
    sweeps = {("add_rms_norm", "tiny"): [{"rows": 2}], ("rope", "tiny"): [{"block_heads": 2}]
              } if dry_run else {
        ("add_rms_norm", "smollm2"): [{"rows": r} for r in (1, 2, 8)] + [{"num_warps": 4}],
        ("add_rms_norm", "llama8b"): [{"num_warps": w} for w in (4, 16)],
        ("rope", "llama8b"): [{"block_heads": b} for b in (4, 8, 32)],
    }
    res["config"] = {"T": lengths, "dtypes": [str(d) for d in dtypes], "shapes": shapes,
                     "compile_budget_s": None if dry_run else FUSED_COMPILE_S}
    points = []  # (kind, shape name, T, dtype)
    for name in shapes:
        for t in lengths:
            for dt in dtypes:
                points += [("add_rms_norm", name, t, dt), ("rope", name, t, dt)]
        # The plain norm runs twice per forward (first input norm, final norm), not twice
        # per layer: one point per shape is enough to see it.
        points.append(("rms_norm", name, lengths[-1], dtypes[0]))

    def key(kind: str, name: str, t: int, dt) -> str:
        return f"{kind}_{name}_T{t}_{str(dt).replace('torch.', '')}"

    for kind, name, t, dt in points:
        sweep = sweeps.get((kind, name)) if t == lengths[-1] and dt == dtypes[0] else None
        guarded(res, key(kind, name, t, dt), fused_point, kind, device, dt, t, shapes[name],
                bw, sweep)

    # torch.compile, second and only while the budget lasts: the eager/kernel numbers above
    # never wait on it. First dtype only (the kernels' verdict does not hinge on fp16).
    import torch._dynamo

    for limit in ("recompile_limit", "cache_size_limit"):  # one entry per shape and dtype
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    if not dry_run:
        try:
            import torch._inductor.config as inductor_config

            # A graph or two of small kernels each: one in-process compile thread is ready
            # at once, where a worker pool would have to start first.
            inductor_config.compile_threads = 1
        except Exception:  # noqa: BLE001 - a tuning knob; its absence changes nothing else
            pass
    failures = 0
    for kind, name, t, dt in points:
        point = res.get(key(kind, name, t, dt))
        if not isinstance(point, dict) or "error" in point or dt != dtypes[0]:
            continue
        if failures >= 2:
            point["torch_compile"] = {"skipped": "torch.compile failed on earlier points"}
        elif time.time() - t_start > FUSED_COMPILE_S:
            point["torch_compile"] = {"skipped": f"section past {FUSED_COMPILE_S:.0f} s"}
        else:
            try:
                # Dry run: dynamo's trace of the eager function only; inductor's CPU codegen
                # is slow and proves nothing about the GPU.
                point["torch_compile"] = fused_compiled(
                    kind, device, dt, t, shapes[name], bw,
                    backend="eager" if dry_run else "inductor")
                point["speedup_vs_compiled"] = round(
                    point["torch_compile"]["us"] / point["triton"]["us"], 2)
            except Exception as e:  # noqa: BLE001 - optional: recorded, then skipped
                failures += 1
                point["torch_compile"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        res.save()


def _engine_model() -> str:
    """SmolLM2-135M itself when its GGUF and the gguf reader are installed; otherwise a
    random-weight model of exactly its shape. The GGUF (98 MB) is too large to carry to the
    GPU machine, and throughput does not depend on the weights' values."""
    try:
        import gguf  # noqa: F401

        from pdserve.engine.model_files import resolve_model

        resolve_model("smollm2-135m")
        return "smollm2-135m"
    except (ImportError, FileNotFoundError):
        return serving.shaped_model(dry_run=False, with_tokenizer=False)


def section_engine_throughput(res: Result, dry_run: bool) -> None:
    from pdserve.engine.config import EngineConfig  # the lead's engine; absent -> ImportError here
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.protocol import SamplingParams

    res["engine_importable"] = True
    res.save()
    if dry_run:
        return
    import torch

    model = _engine_model()
    res["engine_model"] = model
    # token-id prompts of mixed lengths (64..320), so no tokenizer is needed on the machine
    prompts = [[(7 * i + 13 * j) % 49000 + 100 for j in range(64 + (i % 5) * 64)]
               for i in range(64)]

    def make(backend: str):
        return LLMEngine(EngineConfig(model=model, device="cuda",
                                      attention_backend=backend, dtype="bfloat16",
                                      show_progress=False))

    def timed(eng, ps, n: int) -> tuple[float, list]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = eng.generate(ps, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t, outs

    def throughput() -> dict:
        t = time.perf_counter()
        eng = make("triton")
        out = {"load_s": round(time.perf_counter() - t, 1)}
        out["warmup_s"] = round(timed(eng, prompts[:2], 8)[0], 1)  # compiles the kernels
        for batch, n in ((64, 128), (1, 64)):
            dt, outs = timed(eng, prompts[:batch], n)
            tokens = sum(len(o.token_ids) for o in outs)
            out[f"batch{batch}_x{n}"] = {"s": round(dt, 3), "tokens": tokens,
                                        "tok_per_s": round(tokens / dt, 1),
                                        "ms_per_step": round(1e3 * dt / n, 2)}
            res["throughput"] = out
            res.save()
        res["_triton_ids"] = [list(o.token_ids) for o in timed(eng, prompts[:4], 32)[1]]
        return out

    guarded(res, "throughput", throughput)

    def parity() -> dict:
        ids = res.pop("_triton_ids")
        ref = [list(o.token_ids) for o in timed(make("torch"), prompts[:4], 32)[1]]
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                for x, y in zip(ids, ref)]
        return {"first_mismatch_per_prompt": same, "tokens_each": 32}

    guarded(res, "greedy_parity_vs_torch_backend", parity)


SECTION_FNS = {
    "env": section_env,
    "kernel_tests": section_kernel_tests,
    "decode_bandwidth": section_decode_bandwidth,
    "prefill_tflops": section_prefill_tflops,
    "fused_ops": section_fused_ops,
    "engine_throughput": section_engine_throughput,
    "decode_step": serving.section_decode_step,
    "e2e": serving.section_e2e,
}


# ---------------------------------------------------------------- driver


_BOX = {"s": 60.0}  # this child's time box, from the parent


def run_section(name: str, out: Path, dry_run: bool, box: float) -> int:
    _BOX["s"] = box
    res = Result(out)
    try:
        SECTION_FNS[name](res, dry_run)
    except Exception as e:  # noqa: BLE001 - recorded, and the parent carries on
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()[-2000:]
    res.save()
    return 0


def default_out() -> Path:
    return Path(os.environ["OUT"]) / "gpu_report.json" if os.environ.get("OUT") \
        else Path("gpu_report.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="report path")
    ap.add_argument("--dry-run", action="store_true", help="CPU: imports and paths only")
    ap.add_argument("--only", default="", help="comma-separated sections to run")
    ap.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds, overall")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one, in a child
    ap.add_argument("--box", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = (args.out or default_out()).resolve()
    if args.section:
        return run_section(args.section, out, args.dry_run, args.box)

    deadline = time.time() + args.budget
    names = [n for n in SECTIONS if not args.only or n in args.only.split(",")]
    report: dict = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "python": sys.executable, "sections": {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    env = child_env(args.dry_run)
    done: dict[str, dict] = {}
    lock = threading.Lock()

    def record(name: str, res: dict) -> None:
        with lock:  # the report keeps SECTIONS' order whichever lane finishes first
            done[name] = res
            report["sections"] = {n: done[n] for n in names if n in done}
            report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            out.write_text(json.dumps(report, indent=1, default=str))
        if "skipped" not in res.get("error", ""):
            print(f"[gpu_check] {name}: {'error: ' + res['error'] if 'error' in res else 'ok'}"
                  f" ({res['wall_s']} s)", flush=True)

    def run_lane(lane: list[str], tmp: str) -> None:
        for name in lane:
            box = min(SECTIONS[name], deadline - time.time() - 5)
            if box < 10:
                record(name, {"error": "skipped: overall budget spent"})
                continue
            part = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name,
                   "--out", str(part), "--box", str(box)] + (["--dry-run"] if args.dry_run else [])
            t0 = time.time()
            rc, log = run_boxed(cmd, timeout=box, env=env)
            res = json.loads(part.read_text()) if part.exists() else {}
            if rc is None:
                res["error"] = f"timed out after {box:.0f} s (partial results kept)"
            elif rc != 0:
                res.setdefault("error", f"exit code {rc}")
            if "error" in res:
                res["log_tail"] = log[-2000:]
            res["wall_s"] = round(time.time() - t0, 1)
            record(name, res)

    # On a GPU one section at a time: each measures the device alone. A dry run measures
    # nothing, so its serving sections (a tiny engine, a cluster) run in a second lane beside
    # the kernel sections: the same sections and processes, in about half the wall time.
    lanes = [names]
    if args.dry_run:
        lanes = [[n for n in names if n not in DRY_RUN_LANE2],
                 [n for n in names if n in DRY_RUN_LANE2]]
    with tempfile.TemporaryDirectory() as tmp:
        threads = [threading.Thread(target=run_lane, args=(lane, tmp)) for lane in lanes if lane]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    try:
        report["verdict"] = serving.verdict(report)
        serving.print_verdict(report["verdict"])
    except Exception as e:  # noqa: BLE001 - the measurements are saved whatever happens
        report["verdict_error"] = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"[gpu_check] report: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
