"""The C GEMV (engine/cpu_kernels/gemv.c, `pdserve::gemv_linear`) against x @ W.T in
float32, its input checks, and where the CPU layer ops use it.

Tolerances: float32 differs from the reference only in summation order; a bfloat16 result
is the float32 sum of exact bf16 x bf16 products, rounded once, so it is within one bf16
rounding (2^-8 relative) of the float32 reference over the same bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_kernels.amx_linear import amx_available
from pdserve.engine.cpu_kernels.bf16_panels import panels_available
from pdserve.engine.cpu_kernels.f32_panels import panels_available as f32_panels_available
from pdserve.engine.cpu_kernels.gemv import gemv_linear
from pdserve.engine.layers import linear
from pdserve.engine.layers.registry import build_layer_ops

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2 ** -8)}


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 9, 17])  # 9 and 17: past a pass of 8 rows of x
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 64), (100, 33), (17, 5), (3, 70000)])
def test_matches_reference(dtype, m, k, n):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    got = gemv_linear(x, w)
    assert got.shape == (m, n) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.double(), _reference(x, w), **TOL[dtype])


def test_one_thread_and_many_agree():
    # the rows are split between threads by range; each row's sum is the same either way
    x, w = torch.randn(3, 576), torch.randn(5000, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemv_linear(x, w)
        torch.set_num_threads(max(2, threads))
        many = gemv_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_strided_rows_of_x():
    # the model hands it column slices of wider rows (x's row stride > K)
    wide = torch.randn(4, 1000)
    x = wide[:, 100:676]
    w = torch.randn(300, 576)
    assert x.stride(0) == 1000
    torch.testing.assert_close(gemv_linear(x, w).double(), _reference(x, w), **TOL[torch.float32])


def test_empty():
    assert gemv_linear(torch.randn(0, 8), torch.randn(4, 8)).shape == (0, 4)
    assert gemv_linear(torch.randn(2, 8), torch.randn(0, 8)).shape == (2, 0)


def _bad_calls():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    yield (lambda: gemv_linear(x, w.to(torch.bfloat16))), "share float32 or bfloat16"
    yield (lambda: gemv_linear(x.half(), w.half())), "share float32 or bfloat16"
    yield (lambda: gemv_linear(x, torch.randn(4, 9))), r"\[M, K\] and weight \[N, K\]"
    yield (lambda: gemv_linear(x.view(2, 2, 4), w)), r"\[M, K\]"
    yield (lambda: gemv_linear(torch.randn(8, 2).t(), w)), "contiguous in its last"
    yield (lambda: gemv_linear(x, torch.randn(8, 4).t())), "weight contiguous"
    yield (lambda: gemv_linear(x, torch.randn(4, 16)[:, ::2])), "weight contiguous"


@pytest.mark.parametrize("call,match", list(_bad_calls()))
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cpu_ops_use_it_for_decode_rows_only(monkeypatch):
    import gc

    import pdserve.engine.cpu_kernels.gemv as gemv

    gemv_rows, packs = [], []
    real_gemv, real_pack = gemv.gemv_linear, torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(gemv, "gemv_linear", lambda x, w: gemv_rows.append(x.shape[0])
                        or real_gemv(x, w))
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda w, m: packs.append(w.shape) or real_pack(w, m))
    ops = build_layer_ops("cpu", torch.device("cpu"))
    w = torch.randn(64, 32)
    for dtype in (torch.float32, torch.bfloat16):
        wd = w.to(dtype)
        for m in (1, linear.GEMV_MAX_ROWS, linear.GEMV_MAX_ROWS + 1, 100, 3000):
            x = torch.randn(m, 32).to(dtype)
            torch.testing.assert_close(ops.linear(x, wd).double(), _reference(x, wd),
                                       **TOL[dtype])
    # the GEMV took the decode-sized calls; the blocked copy was made once per weight, for
    # the dtypes oneDNN runs on this CPU (F.linear took the others), but where panels take
    # every batch (float32's, bfloat16's without AMX)
    assert gemv_rows == [1, linear.GEMV_MAX_ROWS] * 2
    all_panels = {torch.float32: f32_panels_available(),
                  torch.bfloat16: panels_available() and not amx_available()}
    blocked = [d for d in (torch.float32, torch.bfloat16) if linear.onednn_takes(d)
               and not all_panels[d]]
    assert packs == [(64, 32)] * len(blocked)
    # a weight that goes away takes its blocked copy with it: a new one is packed anew (40
    # rows: no panels take it, so oneDNN does, in float32, everywhere)
    del wd, w
    odd = torch.randn(40, 32)
    ops.linear(torch.randn(linear.BATCH_MAX_ROWS + 1, 32), odd)
    assert len(packs) == len(blocked) + 1
    del odd
    gc.collect()
    ops.linear(torch.randn(linear.BATCH_MAX_ROWS + 1, 32), torch.randn(40, 32))
    assert len(packs) == len(blocked) + 2
    # the eager bundle, the reference, never takes the C path
    assert build_layer_ops("torch", torch.device("cpu")).linear is linear.onednn_linear
