"""The AMX projection (cpu_kernels/amx_linear.c) against float32 matmul: the packed layout,
row counts around the 16-row tiles and the 32-row passes, odd numbers of 16-column blocks,
strided x; bad arguments refused; and the CPU linear routes 5..BATCH_MAX_ROWS bfloat16 rows to
it. Skipped where the CPU (or the kernel) has no AMX tiles."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_kernels.amx_linear import amx_available, amx_linear, amx_pack
from pdserve.engine.layers.linear import BATCH_MAX_ROWS, GEMV_MAX_ROWS, cpu_linear

pytestmark = pytest.mark.skipif(not amx_available(), reason="no AMX tiles on this machine")


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_packing_is_the_tiles_b_layout():
    w = _bf16(48, 64, seed=0)
    # [N/16, K/32, 16 pairs of k, 16 columns, 2]: row r of a tile holds W[n][2r], W[n][2r+1]
    want = w.view(3, 16, 2, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1)
    assert torch.equal(amx_pack(w), want)


@pytest.mark.parametrize("m", [1, 5, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100])
@pytest.mark.parametrize("n,k", [(1728, 576), (48, 1536), (16, 32)])
def test_matches_float32_matmul(m, n, k):
    x, w = _bf16(m, k, seed=m), _bf16(n, k, seed=n + k)
    y = amx_linear(x, amx_pack(w), n)
    ref = x.float() @ w.float().T
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # bf16 products are exact and sums float32: only the output's rounding (2^-8) remains,
    # plus float32 summation order
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-3 * ref.abs().max().item())


def test_strided_rows_of_x():
    base, w = _bf16(40, 700, seed=1), _bf16(32, 576, seed=2)
    x = base[::2, 10:586]  # row stride 1400 elements
    torch.testing.assert_close(amx_linear(x, amx_pack(w), 32).float(),
                               x.float() @ w.float().T, rtol=2 ** -8, atol=1e-2)


@pytest.mark.parametrize("x,packed,n,match", [
    (torch.zeros(2, 64), torch.zeros(32 * 64, dtype=torch.bfloat16), 32, "bfloat16"),
    (torch.zeros(2, 48, dtype=torch.bfloat16), torch.zeros(32 * 48, dtype=torch.bfloat16), 32,
     "K % 32"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(30 * 64, dtype=torch.bfloat16), 30,
     "N % 16"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(16 * 64, dtype=torch.bfloat16), 32,
     "amx_pack of a"),
    (torch.zeros(64, 2, dtype=torch.bfloat16).t(), torch.zeros(32 * 64, dtype=torch.bfloat16),
     32, "contiguous rows"),
])
def test_bad_arguments_are_refused(x, packed, n, match):
    with pytest.raises(ValueError, match=match):
        amx_linear(x, packed, n)


def test_pack_refuses_weights_the_tiles_cannot_take():
    with pytest.raises(ValueError, match="N % 16"):
        amx_pack(torch.zeros(20, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        amx_pack(torch.zeros(32, 64))


def test_the_cpu_linear_uses_the_tiles_between_the_gemv_and_onednn():
    linear = cpu_linear()
    w = _bf16(1728, 576, seed=3)
    packed = amx_pack(w)
    for m in (GEMV_MAX_ROWS + 1, 33, BATCH_MAX_ROWS):
        x = _bf16(m, 576, seed=m)
        assert torch.equal(linear(x, w), amx_linear(x, packed, 1728)), m
    # a shape the tiles cannot take goes to oneDNN, still right
    odd = _bf16(40, 576, seed=4)
    x = _bf16(8, 576, seed=5)
    torch.testing.assert_close(linear(x, odd).float(), x.float() @ odd.float().T,
                               rtol=2 ** -7, atol=1e-2)
