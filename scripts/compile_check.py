"""Compile every Triton kernel ahead of time for a CUDA target, without a GPU.

The interpreter (TRITON_INTERPRET=1) runs the kernels' Python on the CPU and so proves
nothing about what the GPU compiler accepts: an op it lacks, a tile whose pipelined
buffers pass the 227 KiB of shared memory an H100/H200 block may hold, or a config that
spills registers. This script runs the real pipeline (ttir -> ttgir -> llir -> ptx ->
ptxas cubin) for an sm_90 target on the CPU and reports, per kernel and config: whether
it compiled, its shared memory (`metadata.shared`), and the registers and spill bytes
ptxas reports.

The configs are not restated here: each case calls the real launcher
(`pdserve.engine.kernels.*`) with small CPU tensors of the case's shape and dtype, with the
kernels swapped for recorders, so the grid, constexprs and launch options compiled are
exactly those the launcher would pick on a GPU (interpreter-only flags off). Arguments are
specialised as Triton's runtime does (ints == 1 become constexprs, 16-divisible ints and
pointers get divisibility hints), using the installed Triton's own specialisation.

    python scripts/compile_check.py                 # default configs; exit 1 on a failure
    python scripts/compile_check.py --sweep         # + gpu_check's sweep configs (advisory)
    python scripts/compile_check.py --json out.json --only prefill --dtypes bf16

Default configs are required: a compile error, shared memory over --max-shared (227 KiB),
or spills over --max-spill-bytes make the exit status 1. Sweep configs are only reported.
Each case compiles in a worker process (--jobs), so a crash in one is attributed to it.
"""

from __future__ import annotations

import os

# The kernels pick interpreter or compiler when decorated: compile, never interpret.
os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from concurrent.futures.process import BrokenProcessPool  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAX_SHARED_BYTES = 227 * 1024  # H100/H200: opt-in shared memory per block
# Spill stores + loads (bytes per thread) above which a default config fails: a few bytes
# are harmless, the fp32 FMA-dot tiles that prompted this check spilled tens of KB.
MAX_SPILL_BYTES = 256
NEAR_SHARED = 0.9  # noted (not failed) above this fraction of --max-shared
BLOCK_SIZE = 16  # pdserve.engine.config's default KV block size

# name -> (query heads, kv heads, head_dim)
SHAPES = {
    "d128_g4": (32, 8, 128),  # Llama-3-8B-like GQA
    "d64_g3": (9, 3, 64),  # SmolLM2-135M
}
DTYPES = ("fp16", "bf16", "fp32")  # all three are cache dtypes the launchers accept
KERNELS = ("store_kv", "prefill", "decode", "decode_split", "rms_norm", "rotary", "silu_mul")

# Non-default launcher arguments worth knowing about (gpu_check.py's sweeps), advisory.
PREFILL_SWEEP = [
    {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
    for m, n, w, s in ((128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
                       (128, 32, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 3),
                       (256, 64, 8, 2), (128, 64, 4, 3), (128, 64, 4, 2), (128, 128, 4, 3),
                       (128, 64, 4, 4), (256, 64, 8, 3))
]
DECODE_SWEEP = [{"tile_n": t, "num_warps": w}
                for t, w in ((32, 4), (32, 8), (64, 8), (128, 4), (128, 8), (256, 8))]


@dataclass
class Case:
    kernel: str  # one of KERNELS
    shape: str  # key of SHAPES
    dtype: str
    launch: dict = field(default_factory=dict)  # non-default launcher kwargs
    required: bool = True  # a default config: failures fail the run

    @property
    def name(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.launch.items())
        return f"{self.kernel}/{self.shape}/{self.dtype}" + (f"[{extra}]" if extra else "")


@dataclass
class Row:
    case: str
    kernel: str  # the @triton.jit function compiled
    required: bool
    ok: bool = False
    config: dict = field(default_factory=dict)  # constexprs + launch options
    shared: int | None = None
    n_regs: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    compile_s: float | None = None
    error: str | None = None
    problems: list = field(default_factory=list)  # why a compiled kernel is unacceptable
    notes: list = field(default_factory=list)  # worth knowing, not failures

    @property
    def spills(self) -> int | None:
        if self.spill_stores is None:
            return None
        return self.spill_stores + (self.spill_loads or 0)


def build_cases(kernels, shapes, dtypes, sweep: bool) -> list[Case]:
    cases = []
    for shape in shapes:
        for dtype in dtypes:
            for kernel in kernels:
                cases.append(Case(kernel, shape, dtype))
    if sweep:  # the sweeps gpu_check measures, in bf16 (what it measures in)
        for shape in shapes:
            if "prefill" in kernels:
                cases += [Case("prefill", shape, "bf16", dict(c), required=False)
                          for c in PREFILL_SWEEP]
            if "decode" in kernels:
                cases += [Case("decode", shape, "bf16", dict(c), required=False)
                          for c in DECODE_SWEEP]
            if "decode_split" in kernels:
                cases += [Case("decode_split", shape, "bf16", {"tile_n": t}, required=False)
                          for t in (128, 256)]
    return cases


# ---------------------------------------------------------------- capture the launches


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](**kwargs)` records the launch."""

    def __init__(self, fn, launches: list):
        self.fn = fn
        self.launches = launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if args:
                raise TypeError("compile_check expects keyword-only kernel launches")
            self.launches.append((self.fn, grid, kwargs))
        return launch


def capture_launches(case: Case) -> list:
    """Run the case's launcher on CPU tensors; return its [(jit fn, grid, kwargs)]."""
    import torch

    import pdserve.engine.kernels.common as kernels_pkg
    from pdserve.engine.kernels import paged_decode_attention as dec
    from pdserve.engine.kernels import prefill_attention as pre
    from pdserve.engine.kernels import rms_norm as rms
    from pdserve.engine.kernels import rotary as rot
    from pdserve.engine.kernels import silu_mul as act
    from pdserve.engine.kernels import store_kv as sto

    if kernels_pkg.interpreted():
        raise RuntimeError("pdserve.engine.kernels was imported under TRITON_INTERPRET=1; run this "
                           "script in a fresh process without it")
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    hq, hkv, d = SHAPES[case.shape]
    num_blocks = 1024
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, hkv, d, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    launches: list = []
    saved = []

    def patch(module, name, value):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    try:
        for module in (dec, pre, sto, rms, rot, act):
            patch(module, "check_device", lambda *tensors: None)  # CPU tensors stand in
        patch(sto, "_store_kv_kernel", _Recorder(sto._store_kv_kernel, launches))
        patch(pre, "_prefill_kernel", _Recorder(pre._prefill_kernel, launches))
        patch(dec, "_decode_kernel", _Recorder(dec._decode_kernel, launches))
        patch(dec, "_reduce_kernel", _Recorder(dec._reduce_kernel, launches))
        patch(rms, "_rms_norm_kernel", _Recorder(rms._rms_norm_kernel, launches))
        patch(rot, "_rotary_kernel", _Recorder(rot._rotary_kernel, launches))
        patch(act, "_silu_mul_kernel", _Recorder(act._silu_mul_kernel, launches))

        if case.kernel == "store_kv":
            t = 256
            kv = torch.zeros(t, 2, hkv, d, dtype=dt)  # as the model's qkv split hands it over
            sto.store_kv(key=kv[:, 0], value=kv[:, 1], k_cache=k_cache, v_cache=v_cache,
                         slot_mapping=torch.arange(t, dtype=torch.int64), validate=False)
        elif case.kernel == "prefill":
            lens = [2048] * 4
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            per_seq = 2048 // BLOCK_SIZE
            pre.prefill_attention(
                query=torch.zeros(sum(lens), hq, d, dtype=dt), k_cache=k_cache,
                v_cache=v_cache, cu_seqlens=cu, seq_lens=torch.tensor(lens, dtype=torch.int32),
                block_tables=torch.arange(4 * per_seq, dtype=torch.int32).view(4, per_seq),
                scale=d ** -0.5, max_query_len=max(lens), validate=False, **case.launch)
        elif case.kernel in ("decode", "decode_split"):
            batch, ctx = 64, 4096
            per_seq = ctx // BLOCK_SIZE
            tables = torch.zeros(batch, per_seq, dtype=torch.int32)
            dec.paged_decode_attention(
                query=torch.zeros(batch, hq, d, dtype=dt), k_cache=k_cache, v_cache=v_cache,
                seq_lens=torch.full((batch,), ctx, dtype=torch.int32), block_tables=tables,
                scale=d ** -0.5, max_seq_len=ctx, validate=False,
                split_k=case.kernel == "decode_split", **case.launch)
        elif case.kernel == "rms_norm":
            # The model's hidden size is hq * d for both shapes. Two launches: the fused add
            # at a prefill's length (several rows per program for small hidden sizes) and
            # the plain norm at a decode batch's (one row per program).
            hidden = hq * d
            x = torch.zeros(4096, hidden, dtype=dt)
            w = torch.ones(hidden, dtype=dt)
            rms.add_rms_norm(x=x, weight=w, eps=1e-5, residual=torch.zeros_like(x))
            rms.add_rms_norm(x=x[:64], weight=w, eps=1e-5)
        elif case.kernel == "rotary":
            t, max_position = 256, 8192
            rot.rotary_embedding(
                qkv=torch.zeros(t, (hq + 2 * hkv) * d, dtype=dt),
                cos=torch.zeros(max_position, d, dtype=dt),
                sin=torch.zeros(max_position, d, dtype=dt),
                positions=torch.arange(t, dtype=torch.int64), num_q_heads=hq,
                num_kv_heads=hkv, head_dim=d, validate=False)
        elif case.kernel == "silu_mul":
            # intermediate size 4 * hidden (the kernel's block is capped, so any wide row
            # compiles the same config)
            act.silu_mul(torch.zeros(256, 2 * 4 * hq * d, dtype=dt))
        else:
            raise ValueError(f"unknown kernel {case.kernel!r}")
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
    if not launches:
        raise RuntimeError(f"{case.name}: the launcher launched nothing")
    return launches


def specialize(fn, kwargs: dict):
    """(signature, constexprs, attrs, options) as Triton's runtime would build them."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    names = [p.name for p in fn.params]
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.name not in kwargs:
            raise KeyError(f"{fn.__name__}: argument {p.name!r} not passed by the launcher")
        val = kwargs[p.name]
        if p.is_constexpr:
            ty, attr = "constexpr", None
        else:
            ty, attr = native_specialize_impl(CUDABackend, val, False, not p.do_not_specialize,
                                              not p.do_not_specialize_on_alignment)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = val
        elif isinstance(attr, str):
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    options = {k: v for k, v in kwargs.items() if k not in names}
    return signature, constexprs, attrs, options


_PTXAS_RE = {
    "n_regs": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def compile_launch(case: Case, fn, kwargs: dict, arch: int) -> Row:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = Row(case=case.name, kernel=fn.__name__, required=case.required)
    signature, constexprs, attrs, options = specialize(fn, kwargs)
    names = [p.name for p in fn.params]
    row.config = {names[i[0]]: v for i, v in constexprs.items()}
    row.config.update(options)
    knobs.compilation.always_compile = True  # ptxas must run for its register report
    knobs.nvidia.dump_ptxas_log = True  # ... which make_cubin then prints to stdout
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn=fn, signature=signature,
                                                constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:  # noqa: BLE001 - any compile error is the finding
        row.compile_s = round(time.perf_counter() - t0, 2)
        msg = f"{type(e).__name__}: {e}"
        row.error = msg if len(msg) < 4000 else msg[:1500] + "\n...\n" + msg[-2000:]
        return row
    row.compile_s = round(time.perf_counter() - t0, 2)
    row.ok = True
    row.shared = int(compiled.metadata.shared)
    text = log.getvalue()
    # A kernel's log can hold several functions (noinline helpers); the entry's comes first.
    for key, rx in _PTXAS_RE.items():
        m = rx.search(text)
        if m:
            setattr(row, key, int(m.group(1)))
    if row.n_regs is None:
        row.problems.append("no ptxas register report (log not captured)")
    return row


def run_case(case: Case, arch: int, cache_dir: str) -> list[Row]:
    """Worker entry: capture the case's launches and compile each (fresh process)."""
    import warnings

    os.environ["TRITON_CACHE_DIR"] = cache_dir
    # Triton 3.9 warns once per process that its FP-fusion default will change; the
    # launchers pass nothing, so these compiles take the default a GPU launch takes.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    try:
        launches = capture_launches(case)
    except Exception:  # noqa: BLE001
        return [Row(case=case.name, kernel="?", required=case.required,
                    error="launcher capture failed:\n" + traceback.format_exc(limit=4))]
    return [compile_launch(case, fn, kwargs, arch) for fn, _grid, kwargs in launches]


def judge(row: Row, max_shared: int, max_spill: int) -> None:
    if not row.ok:
        return
    if row.shared is not None and row.shared > max_shared:
        row.problems.append(f"shared memory {row.shared} B > {max_shared} B")
    elif row.shared is not None and row.shared > NEAR_SHARED * max_shared:
        row.notes.append(f"shared memory {row.shared} B is within "
                         f"{100 * (1 - NEAR_SHARED):.0f}% of {max_shared} B")
    if row.spills and row.spills <= max_spill:
        row.notes.append(f"spills {row.spills} B (under the {max_spill} B limit)")
    if row.spills is not None and row.spills > max_spill:
        row.problems.append(f"spills {row.spill_stores} B stored + {row.spill_loads} B loaded "
                            f"> {max_spill} B")


def failed(row: Row) -> bool:
    return not row.ok or bool(row.problems)


# ---------------------------------------------------------------- report


def ptxas_info() -> dict:
    """The ptxas Triton would use for sm_90 ({} and an error when there is none)."""
    import subprocess

    from triton import knobs
    try:
        tool = knobs.nvidia.ptxas_blackwell
        path = tool.path
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        ver = re.search(r"release ([\d.]+)", out.stdout)
        return {"path": path, "version": ver.group(1) if ver else out.stdout.strip()[-80:]}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def _fmt(v) -> str:
    return "-" if v is None else str(v)


def print_table(rows: list[Row]) -> None:
    headers = ("case", "kernel", "ok", "shared B", "regs", "spill B", "warps", "stages",
               "compile s")
    table = []
    for r in rows:
        status = "ok" if r.ok and not r.problems else ("FAIL" if r.required else "fail")
        if not r.required and r.ok and not r.problems:
            status = "ok*"
        table.append((r.case, r.kernel, status, _fmt(r.shared), _fmt(r.n_regs),
                      _fmt(r.spills), _fmt(r.config.get("num_warps")),
                      _fmt(r.config.get("num_stages")), _fmt(r.compile_s)))
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)))
    for r in rows:
        if failed(r):
            tag = "REQUIRED" if r.required else "advisory"
            print(f"\n[{tag}] {r.case} ({r.kernel}): "
                  + ("; ".join(r.problems) if r.ok else "compile failed"))
            if r.error:
                print("    " + r.error.strip().replace("\n", "\n    "))
    for r in rows:
        if r.notes and not failed(r):
            print(f"\n[note] {r.case} ({r.kernel}): " + "; ".join(r.notes))
    if any(not r.required for r in rows):
        print("\nok* = advisory (non-default) config; num_stages '-' = Triton's default")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100/H200)")
    ap.add_argument("--only", default=",".join(KERNELS),
                    help=f"comma-separated kernels of {KERNELS}")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {tuple(SHAPES)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"of {DTYPES}")
    ap.add_argument("--sweep", action="store_true",
                    help="also compile gpu_check's sweep configs (advisory)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--max-shared", type=int, default=MAX_SHARED_BYTES)
    ap.add_argument("--max-spill-bytes", type=int, default=MAX_SPILL_BYTES)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    def pick(arg, allowed):
        vals = [v for v in arg.split(",") if v]
        bad = [v for v in vals if v not in allowed]
        if bad:
            ap.error(f"unknown {bad}, choose from {tuple(allowed)}")
        return vals

    cases = build_cases(pick(args.only, KERNELS), pick(args.shapes, SHAPES),
                        pick(args.dtypes, DTYPES), args.sweep)
    info = ptxas_info()
    import triton
    print(f"triton {triton.__version__}, target sm_{args.arch}, ptxas "
          f"{info.get('version', info.get('error'))}; {len(cases)} cases, {args.jobs} jobs",
          flush=True)
    if "error" in info:
        print("no usable ptxas: cannot compile for CUDA", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    rows_by_case: dict[str, list[Row]] = {}
    with tempfile.TemporaryDirectory(prefix="compile_check_cache_") as cache_dir:
        def run_pool(batch: list[Case], jobs: int) -> list[Case]:
            """Compile `batch`; return the cases a crashed worker took down."""
            crashed = []
            try:
                with ProcessPoolExecutor(max_workers=jobs) as pool:
                    futs = [(c, pool.submit(run_case, c, args.arch, cache_dir)) for c in batch]
                    for c, f in futs:
                        try:
                            rows_by_case[c.name] = f.result()
                        except BrokenProcessPool:
                            crashed.append(c)
            except BrokenProcessPool:
                pass
            return crashed

        # A crash breaks the whole pool: retry what it took down, each in its own worker.
        for c in run_pool(cases, max(1, args.jobs)):
            if run_pool([c], 1):
                rows_by_case[c.name] = [Row(case=c.name, kernel="?", required=c.required,
                                            error="compile worker process crashed")]
    rows = [r for c in cases for r in rows_by_case.get(c.name, [])]
    for r in rows:
        judge(r, args.max_shared, args.max_spill_bytes)
    print_table(rows)
    bad = [r for r in rows if r.required and failed(r)]
    advisory = [r for r in rows if not r.required and failed(r)]
    print(f"\n{len(rows)} kernel compiles in {time.perf_counter() - t0:.0f} s: "
          f"{len(bad)} required failure(s), {len(advisory)} advisory failure(s)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "triton": triton.__version__, "arch": args.arch, "ptxas": info,
            "max_shared": args.max_shared, "max_spill_bytes": args.max_spill_bytes,
            "rows": [{**asdict(r), "spills": r.spills, "failed": failed(r)} for r in rows],
        }, indent=1, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
