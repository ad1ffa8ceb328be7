"""The bfloat16 panel projection (cpu_kernels/bf16_panels.c: AVX512-BF16, or its AVX2 form
on float32 widenings) against float64 matmul: the k-paired packed layout, row counts around
its row blocks, one and many panels, strided x; every output the same bits whatever rows
are beside it; the one rounding to bfloat16 to nearest even, NaNs kept; bad arguments
refused; and where the CPU has no AMX tiles the CPU linear routes every batch above the GEMV
(5 rows and up) to it. Skipped where the build has neither form."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_kernels.amx_linear import amx_available
from pdserve.engine.cpu_kernels.bf16_panels import bf16_pack, bf16_panels_linear, panels_available
from pdserve.engine.layers.linear import BATCH_MAX_ROWS, GEMV_MAX_ROWS, batch_packed, cpu_linear

pytestmark = pytest.mark.skipif(not panels_available(), reason="no bfloat16 panels in this build")


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_packing_is_panels_of_32_columns_by_k_pairs():
    w = _bf16(64, 6, seed=0)
    # [N/32, K/2, 32, 2]: panel p, pair k2 holds (W[32p + j][2 k2], W[32p + j][2 k2 + 1])
    want = w.view(2, 32, 3, 2).permute(0, 2, 1, 3).reshape(-1)
    assert torch.equal(bf16_pack(w), want)


@pytest.mark.parametrize("m", [1, 5, 11, 12, 13, 24, 25, 37, 64, 65])
@pytest.mark.parametrize("n,k", [(960, 576), (32, 1536), (64, 6)])
def test_matches_float64_matmul(m, n, k):
    x, w = _bf16(m, k, seed=m), _bf16(n, k, seed=n + k)
    y = bf16_panels_linear(x, bf16_pack(w), n)
    ref = x.double() @ w.double().T
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # float32 sums of exact products, rounded once to bfloat16 (relative 2^-8)
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -8, atol=1e-5 * k ** 0.5)


def test_a_row_gets_the_same_bits_whatever_rows_are_beside_it():
    """The decode stack's batched form and the layer loop must agree bit for bit: a row's
    outputs may not depend on the block it fell in."""
    x, w = _bf16(37, 576, seed=6), _bf16(128, 576, seed=7)
    packed = bf16_pack(w)
    whole = bf16_panels_linear(x, packed, 128)
    for lo, hi in ((0, 1), (5, 30), (13, 37), (36, 37)):
        assert torch.equal(bf16_panels_linear(x[lo:hi], packed, 128), whole[lo:hi])


def test_one_rounding_to_nearest_even_and_nans_kept():
    """One-hot rows make each output one exact float32 product: the kernel's only rounding
    is then torch's (to nearest even); a NaN in a row makes its every output NaN."""
    w = _bf16(64, 96, seed=8)
    scale = _bf16(96, seed=9) * 3
    x = torch.zeros(96, 96, dtype=torch.bfloat16)
    x[torch.arange(96), torch.arange(96)] = scale  # row k picks column k of w
    y = bf16_panels_linear(x, bf16_pack(w), 64)
    want = (scale.float()[:, None] * w.float().T).bfloat16()
    assert torch.equal(y, want)
    assert not torch.equal(y, (scale.float()[:, None] * w.float().T).view(torch.int32)
                           .bitwise_and(-65536).view(torch.float32).bfloat16()), \
        "every product fit bfloat16: the rounding went untested"
    x[7, 3] = float("nan")
    y = bf16_panels_linear(x[:10], bf16_pack(w), 64)
    assert y[7].isnan().all() and not y[[0, 1, 2, 3, 4, 5, 6, 8, 9]].isnan().any()


def test_strided_rows_of_x():
    base, w = _bf16(40, 700, seed=1), _bf16(32, 576, seed=2)
    x = base[::2, 10:586]  # row stride 1400 elements
    torch.testing.assert_close(bf16_panels_linear(x, bf16_pack(w), 32).double(),
                               x.double() @ w.double().T, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("x,packed,n,match", [
    (torch.zeros(2, 64), torch.zeros(32 * 64, dtype=torch.bfloat16), 32, "bfloat16"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(30 * 64, dtype=torch.bfloat16), 30,
     "N % 32"),
    (torch.zeros(2, 63, dtype=torch.bfloat16), torch.zeros(32 * 63, dtype=torch.bfloat16), 32,
     "K % 2"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(32 * 62, dtype=torch.bfloat16), 32,
     "bf16_pack of a"),
    (torch.zeros(64, 2, dtype=torch.bfloat16).t(), torch.zeros(32 * 64, dtype=torch.bfloat16),
     32, "contiguous rows"),
])
def test_bad_arguments_are_refused(x, packed, n, match):
    with pytest.raises(ValueError, match=match):
        bf16_panels_linear(x, packed, n)


def test_pack_refuses_weights_it_cannot_take():
    with pytest.raises(ValueError, match="K % 2"):
        bf16_pack(torch.zeros(32, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        bf16_pack(torch.zeros(32, 64))


@pytest.mark.skipif(amx_available(), reason="AMX tiles take bfloat16 batches here")
def test_the_cpu_linear_uses_the_panels_above_the_gemv():
    linear = cpu_linear()
    w = _bf16(960, 576, seed=3)
    packed = bf16_pack(w)
    assert torch.equal(batch_packed(w), packed)
    for m in (GEMV_MAX_ROWS + 1, 33, BATCH_MAX_ROWS):
        x = _bf16(m, 576, seed=m)
        assert torch.equal(linear(x, w), bf16_panels_linear(x, packed, 960)), m
    # and past BATCH_MAX_ROWS, at prefill sizes, where they beat oneDNN too
    for m in (BATCH_MAX_ROWS + 1, 300):
        x = _bf16(m, 576, seed=m)
        assert torch.equal(linear(x, w), bf16_panels_linear(x, packed, 960)), m
        torch.testing.assert_close(linear(x, w).double(), x.double() @ w.double().T,
                                   rtol=2 ** -7, atol=1e-2)
