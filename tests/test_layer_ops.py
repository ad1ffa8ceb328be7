"""The C layer ops (engine/cpu_kernels/layer_ops.c) against the eager-torch references of
pdserve.engine.layers (the `torch` bundle): residual add + RMSNorm, RoPE in place,
SiLU-and-multiply; their input checks; and which implementation the model picks.

Tolerances: float32 differs from the reference only in summation order (1e-5). In
bfloat16 the reference rounds to bf16 after every op and the kernels once at the end, so
a result may differ by two bf16 roundings (2 * 2^-8 relative); RoPE's reference also rounds
both products before their sum, where cancellation can leave that error absolute, bounded
by 2^-8 of the inputs' magnitude (|x| < 5 here): atol 3e-2, rtol 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_kernels.layer_ops import add_rms_norm, rope_, silu_mul
from pdserve.engine.layers import registry
from pdserve.engine.layers.registry import build_layer_ops, layer_ops

REF, CPU = (build_layer_ops(name, torch.device("cpu")) for name in ("torch", "cpu"))
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
# 0 and 1 rows; 300 x 576 is past the size where rows are split over threads
ROWS = [0, 1, 7, 300]


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).clamp(-5, 5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("h", [64, 576, 1000])  # 1000: a chunk remainder, not a SIMD multiple
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference(dtype, t, h, with_delta):
    gen = torch.Generator().manual_seed(t * 7 + h)
    x = _randn(t, h, dtype=dtype, gen=gen)
    delta = _randn(t, h, dtype=dtype, gen=gen) if with_delta else None
    w = _randn(h, dtype=dtype, gen=gen)
    x_ref, x_cpu = x.clone(), x.clone()
    want = REF.add_rms_norm(x_ref, delta, w, 1e-5)
    got = CPU.add_rms_norm(x_cpu, delta, w, 1e-5)
    # the residual stream is rounded once in both: equal, bit for bit
    assert torch.equal(x_cpu, x_ref)
    assert got.dtype == dtype and got.shape == (t, h) and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_add_rms_norm_on_strided_rows():
    gen = torch.Generator().manual_seed(1)
    base = _randn(10, 200, dtype=torch.float32, gen=gen)
    x = base[:, 8:136]  # row stride 200
    delta, w = _randn(10, 128, dtype=torch.float32, gen=gen), _randn(128, dtype=torch.float32,
                                                                     gen=gen)
    expect_x = x.clone()
    want = REF.add_rms_norm(expect_x, delta, w, 1e-6)
    before = base.clone()
    got = add_rms_norm(x, delta, w, 1e-6)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(x, expect_x)
    assert torch.equal(base[:, :8], before[:, :8]) and torch.equal(base[:, 136:],
                                                                   before[:, 136:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("heads,d", [(12, 64), (3, 128), (5, 10)])
def test_rope_matches_reference(dtype, t, heads, d):
    gen = torch.Generator().manual_seed(t + d)
    width = heads * d + 3 * d  # a fused-QKV row: Q/K heads first, V after
    qkv = _randn(t, width, dtype=dtype, gen=gen)
    pos = torch.randint(0, 64, (t,), generator=gen)
    if t:
        pos[0], pos[-1] = 0, 63  # both ends of the tables
    angle = torch.outer(torch.arange(64.0), torch.rand(d // 2, generator=gen))
    cos = torch.cat([angle.cos()] * 2, dim=1).to(dtype)
    sin = torch.cat([angle.sin()] * 2, dim=1).to(dtype)
    want = REF.rope(qkv[:, :heads * d].view(t, heads, d), REF.rope_tables(pos, cos, sin))
    got_buf = qkv.clone()
    got = CPU.rope(got_buf[:, :heads * d].view(t, heads, d), CPU.rope_tables(pos, cos, sin))
    assert got.data_ptr() == got_buf.data_ptr()  # in place, in the QKV rows
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert torch.equal(got_buf[:, heads * d:], qkv[:, heads * d:])  # V untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("inter", [64, 1000, 1536])
def test_silu_mul_matches_reference(dtype, t, inter):
    gen = torch.Generator().manual_seed(t + inter)
    gate_up = _randn(t, 2 * inter, dtype=dtype, gen=gen)
    got = CPU.silu_mul(gate_up)
    assert got.shape == (t, inter) and got.dtype == dtype
    torch.testing.assert_close(got.float(), REF.silu_mul(gate_up).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_extreme_gates(dtype):
    # Gates far past +-88, where exp(-gate) over- or underflows (real models have them):
    # the kernel clamps exp's argument (common.h), and silu must still be the gate itself
    # above and 0 below, with no inf or NaN
    gate = torch.tensor([-1e4, -500.0, -100.0, -89.0, -80.0, -3.0, 0.0, 3.0, 80.0, 89.0,
                         100.0, 500.0, 1e4] * 3)
    gate_up = torch.cat([gate, torch.full_like(gate, 0.5)]).view(1, -1).to(dtype)
    got = CPU.silu_mul(gate_up)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), REF.silu_mul(gate_up).float(), **TOL[dtype])


def test_rope_position_outside_tables_raises_and_writes_nothing():
    qk = torch.randn(4, 2, 8)
    before = qk.clone()
    cos = sin = torch.ones(16, 8)
    for bad in (16, -1):
        pos = torch.tensor([0, 3, bad, 1])
        with pytest.raises(ValueError, match=r"positions\[2\] = .* outside the RoPE tables"):
            rope_(qk, pos, cos, sin)
        assert torch.equal(qk, before)


def _bad_calls():
    f32, bf16 = torch.float32, torch.bfloat16
    x, w = torch.randn(3, 8), torch.randn(8)
    yield (lambda: add_rms_norm(x.half(), None, w.half(), 1e-5)), "float32 or bfloat16"
    yield (lambda: add_rms_norm(x, None, w.to(bf16), 1e-5)), "the others"
    yield (lambda: add_rms_norm(x, None, torch.randn(9), 1e-5)), "weight"
    yield (lambda: add_rms_norm(x, torch.randn(3, 9), w, 1e-5)), "delta must be"
    yield (lambda: add_rms_norm(x, None, torch.randn(16)[::2], 1e-5)), "contiguous"
    yield (lambda: add_rms_norm(torch.randn(8, 3).t(), None, torch.randn(3), 1e-5)), \
        "contiguous in its last dimension"
    qk, tab = torch.randn(2, 3, 8), torch.randn(5, 8)
    yield (lambda: rope_(qk, torch.zeros(2, dtype=torch.int32), tab, tab)), "int64"
    yield (lambda: rope_(qk, torch.zeros(3, dtype=torch.long), tab, tab)), "int64 \\[2\\]"
    yield (lambda: rope_(qk, torch.zeros(2, dtype=torch.long), torch.randn(5, 6), tab)), \
        "cos and sin"
    yield (lambda: rope_(torch.randn(2, 3, 7), torch.zeros(2, dtype=torch.long),
                         torch.randn(5, 7), torch.randn(5, 7))), "even"
    yield (lambda: rope_(torch.randn(2, 8, 3).transpose(1, 2), torch.zeros(2, dtype=torch.long),
                         tab, tab)), "packed heads|contiguous"
    yield (lambda: silu_mul(torch.randn(3, 7))), "2I"
    yield (lambda: silu_mul(torch.randn(8, 3).t())), "contiguous"
    yield (lambda: silu_mul(torch.randn(3, 8, dtype=f32).to(torch.float64))), "float32 or"


@pytest.mark.parametrize("call,match", list(_bad_calls()))
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_model_picks_cpu_ops_and_falls_back(monkeypatch, caplog):
    import logging

    from pdserve.engine.cpu_kernels.build import KernelBuildError

    assert layer_ops("cpu").name == "cpu"
    assert layer_ops("cpu").add_rms_norm is add_rms_norm  # the typed op itself

    def broken():
        raise KernelBuildError("no C compiler found\nmore compiler output")

    monkeypatch.setattr("pdserve.engine.cpu_kernels.library.load", broken)
    monkeypatch.setattr(registry, "_warned", set())
    with caplog.at_level(logging.WARNING):
        ops = layer_ops(torch.device("cpu"))
        assert layer_ops(torch.device("cpu")).name == "torch"
    assert ops.name == "torch"
    # one line, once, naming the fallback
    assert [r.getMessage() for r in caplog.records] == [
        "cpu layer ops unavailable (no C compiler found); using the eager torch layer ops"]
    with pytest.raises(KernelBuildError):
        build_layer_ops("cpu", torch.device("cpu"))  # asked for by name: the error
