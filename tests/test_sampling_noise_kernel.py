"""`pdserve::exponential_noise` (cpu_kernels/sampling_noise.c) against the torch formula of
pdserve.engine.sampling_noise, and the CPU sampler drawing through it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_kernels.sampling_noise import exponential_noise as noise_op
from pdserve.engine.sampling_noise import exponential_noise, noise_from_keys, row_keys

# libmvec's vector logf against torch's: a few ulp of float32 (u itself is bit-equal)
REL_TOL = 6e-7


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 5000), (64, 4097), (2, 1), (5, 31)])
def test_kernel_matches_the_torch_formula(rows, vocab):
    keys = row_keys(torch.randint(0, 2**62, (rows,)), torch.randint(0, 4096, (rows,)))
    got, ref = noise_op(keys, vocab), noise_from_keys(keys, vocab)
    assert got.shape == (rows, vocab) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=REL_TOL, atol=0)


def test_extreme_keys_and_the_uniforms_ends():
    keys = torch.tensor([0, 2**32 - 1, 0x9E3779B9], dtype=torch.int64)
    got, ref = noise_op(keys, 70000), noise_from_keys(keys, 70000)
    torch.testing.assert_close(got, ref, rtol=REL_TOL, atol=0)
    assert got.min() > 0 and torch.isfinite(got).all()
    # u in (0, 1): -log(u) is at most -log(2**-25) = 25 log 2
    assert float(got.max()) <= 25 * float(torch.log(torch.tensor(2.0))) + 1e-5


def test_rows_are_independent_of_their_batch():
    keys = row_keys(torch.arange(10, 16), torch.arange(6))
    batch = noise_op(keys, 9000)
    for r in range(6):
        assert torch.equal(noise_op(keys[r:r + 1], 9000)[0], batch[r])


def test_cpu_exponential_noise_goes_through_the_kernel():
    seeds, pos = torch.tensor([7, 2**40 + 3]), torch.tensor([0, 11])
    assert torch.equal(exponential_noise(seeds, pos, 3000), noise_op(row_keys(seeds, pos), 3000))


def test_empty_shapes():
    assert noise_op(torch.zeros(0, dtype=torch.int64), 10).shape == (0, 10)
    assert noise_op(torch.tensor([1]), 0).shape == (1, 0)


@pytest.mark.parametrize("keys,vocab,match", [
    (torch.tensor([1.0]), 4, "int64"),
    (torch.tensor([[1, 2]]), 4, r"\[B\]"),
    (torch.tensor([1, 2, 3, 4])[::2], 4, "contiguous"),
    (torch.tensor([-1]), 4, r"\[0, 2\*\*32\)"),
    (torch.tensor([2**32]), 4, r"\[0, 2\*\*32\)"),
    (torch.tensor([1]), -1, "vocab"),
])
def test_bad_arguments_are_refused(keys, vocab, match):
    with pytest.raises(ValueError, match=match):
        noise_op(keys, vocab)
