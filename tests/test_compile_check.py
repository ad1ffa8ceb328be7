"""scripts/compile_check.py on the CPU: every kernel compiles for sm_90 (ptxas included) at
the configs its launcher picks, within the H100/H200 shared memory limit and without heavy
spills. Catches what the interpreter cannot: a GPU compile failure before a GPU session.

Runs the script in a subprocess: it must import the kernels without TRITON_INTERPRET, which
other tests in this process may have set before pdserve.engine.kernels was first imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ptxas_problem() -> str | None:
    """Why this triton install cannot compile for CUDA, or None when it can."""
    try:
        import triton  # noqa: F401
        from triton import knobs
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"triton's CUDA backend is not importable: {type(e).__name__}: {e}"
    try:
        path = knobs.nvidia.ptxas_blackwell.path  # the ptxas Triton uses for sm_90+
        subprocess.run([path, "--version"], check=True, capture_output=True, timeout=30)
    except Exception as e:  # noqa: BLE001
        return f"no runnable ptxas in this triton install: {type(e).__name__}: {e}"
    return None


def test_every_kernel_compiles_for_sm90(tmp_path):
    reason = _ptxas_problem()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "compile_check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_check.py"), "--jobs", "2",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    # Every default case compiled: 2 shapes x 3 dtypes x (store_kv, prefill, decode,
    # decode split + reduce, rms_norm with and without the residual add, rotary, silu_mul).
    assert len(rows) == 2 * 3 * 9, [r["case"] for r in rows]
    assert all(r["ok"] and not r["failed"] for r in rows)
    assert {r["kernel"] for r in rows} == {"_store_kv_kernel", "_prefill_kernel",
                                           "_decode_kernel", "_reduce_kernel",
                                           "_rms_norm_kernel", "_rotary_kernel",
                                           "_silu_mul_kernel"}
    for r in rows:
        assert 0 <= r["shared"] <= 227 * 1024, r
        assert r["n_regs"] and r["n_regs"] <= 255, r
    # The config compiled is the launcher's: the prefill defaults for 16-bit caches.
    pre = next(r for r in rows if r["case"] == "prefill/d128_g4/bf16")
    assert (pre["config"]["BLOCK_M"], pre["config"]["BLOCK_N"], pre["config"]["GROUP"],
            pre["config"]["num_stages"], pre["config"]["num_warps"]) == (128, 64, 4, 3, 8)
    assert pre["config"]["DOT_PRECISION"] == "tf32" and pre["config"]["UPCAST_DOT"] is False


def test_failure_is_loud(tmp_path):
    """A limit a default config exceeds turns into exit status 1 and a REQUIRED line."""
    if _ptxas_problem():
        pytest.skip(_ptxas_problem())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_check.py"), "--only", "store_kv",
         "--shapes", "d64_g3", "--dtypes", "fp16", "--max-shared", "-1", "--jobs", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "[REQUIRED] store_kv/d64_g3/fp16" in proc.stdout
