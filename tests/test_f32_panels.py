"""The float32 panel projection (cpu_kernels/f32_panels.c) against float64 matmul: the
packed layout, row counts around its 12-row blocks, one and many panels, strided x; every
output one FMA chain whatever the rows beside it; bad arguments refused; and the CPU linear
routes every float32 batch past the GEMV's rows to it. Skipped where the build has no
panels (AVX-512, or AVX2 with FMA)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_kernels.f32_panels import f32_pack, f32_panels_linear, panels_available
from pdserve.engine.layers.linear import BATCH_MAX_ROWS, GEMV_MAX_ROWS, cpu_linear

pytestmark = pytest.mark.skipif(not panels_available(), reason="no panels kernel in this build")


def _f32(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_packing_is_k_major_panels_of_32_columns():
    w = _f32(96, 40, seed=0)
    # [N/32, K, 32]: panel p holds W[32p .. 32p+31][k] at row k
    want = w.view(3, 32, 40).permute(0, 2, 1).reshape(-1)
    assert torch.equal(f32_pack(w), want)


@pytest.mark.parametrize("m", [1, 5, 11, 12, 13, 24, 25, 37, 64, 65])
@pytest.mark.parametrize("n,k", [(960, 576), (32, 1536), (64, 7)])
def test_matches_float64_matmul(m, n, k):
    x, w = _f32(m, k, seed=m), _f32(n, k, seed=n + k)
    y = f32_panels_linear(x, f32_pack(w), n)
    ref = x.double() @ w.double().T
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_a_row_gets_the_same_bits_whatever_rows_are_beside_it():
    """The decode stack's batched form and the layer loop must agree bit for bit: a row's
    outputs may not depend on the 12-row block it fell in."""
    x, w = _f32(37, 576, seed=6), _f32(128, 576, seed=7)
    packed = f32_pack(w)
    whole = f32_panels_linear(x, packed, 128)
    for lo, hi in ((0, 1), (5, 30), (13, 37), (36, 37)):
        assert torch.equal(f32_panels_linear(x[lo:hi], packed, 128), whole[lo:hi])


def test_strided_rows_of_x():
    base, w = _f32(40, 700, seed=1), _f32(32, 576, seed=2)
    x = base[::2, 10:586]  # row stride 1400 elements
    torch.testing.assert_close(f32_panels_linear(x, f32_pack(w), 32), x @ w.T, rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("x,packed,n,match", [
    (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(32 * 64), 32, "float32"),
    (torch.zeros(2, 64), torch.zeros(30 * 64), 30, "N % 32"),
    (torch.zeros(2, 64), torch.zeros(32 * 63), 32, "f32_pack of a"),
    (torch.zeros(64, 2).t(), torch.zeros(32 * 64), 32, "contiguous rows"),
])
def test_bad_arguments_are_refused(x, packed, n, match):
    with pytest.raises(ValueError, match=match):
        f32_panels_linear(x, packed, n)


def test_pack_refuses_weights_it_cannot_take():
    with pytest.raises(ValueError, match="N % 32"):
        f32_pack(torch.zeros(20, 64))
    with pytest.raises(ValueError, match="float32"):
        f32_pack(torch.zeros(32, 64, dtype=torch.bfloat16))


def test_the_cpu_linear_uses_the_panels_past_the_gemv():
    linear = cpu_linear()
    w = _f32(960, 576, seed=3)
    packed = f32_pack(w)
    # decode batches, and prefill chunks past BATCH_MAX_ROWS
    for m in (GEMV_MAX_ROWS + 1, 33, BATCH_MAX_ROWS, BATCH_MAX_ROWS + 1, 300):
        x = _f32(m, 576, seed=m)
        assert torch.equal(linear(x, w), f32_panels_linear(x, packed, 960)), m
    # a shape the panels cannot take goes to oneDNN, still right
    odd = _f32(40, 576, seed=4)
    x = _f32(8, 576, seed=5)
    torch.testing.assert_close(linear(x, odd), x @ odd.T, rtol=1e-4, atol=1e-4)
