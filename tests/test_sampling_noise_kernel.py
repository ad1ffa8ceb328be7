"""`pdserve::exponential_noise` and `pdserve::exponential_race` (cpu_kernels/sampling_noise.c)
against the torch formulas of pdserve.engine.sampling_noise, and the CPU sampler drawing
through them."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_kernels.sampling_noise import exponential_noise as noise_op
from pdserve.engine.cpu_kernels.sampling_noise import exponential_race as race_op
from pdserve.engine.sampling_noise import (
    exponential_noise,
    exponential_race,
    noise_from_keys,
    race_from_keys,
    row_keys,
)

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


# a key whose vocab entry 0 hashes to the top 24 bits 0xFFFFFF: its u rounds to 1.0
TOP_KEY = 27206443


def test_the_uniform_that_rounds_to_one_has_a_tiny_noise_not_zero():
    """u = (0xFFFFFF + 0.5) / 2**24 rounds to 1 in float32. Its noise is 2**-25 (about
    -log(1 - 2**-25)), in both formulas: a zero made a filtered token's score 0 / 0 in the
    torch race, and argmax picks a NaN, so the GPU sampler drew a token top-p had cut."""
    from pdserve.engine.sampling_noise import NOISE_MIN, _mix32

    assert int(_mix32(torch.tensor([TOP_KEY])) >> 8) == 0xFFFFFF
    keys = torch.tensor([TOP_KEY])
    for noise in (noise_op(keys, 4), noise_from_keys(keys, 4)):
        assert float(noise[0, 0]) == NOISE_MIN and (noise > 0).all()
    logits = torch.tensor([[0.0, 5.0, float("-inf"), 1.0]])
    filtered = logits.clone()
    filtered[0, 0] = float("-inf")  # cut: never drawn, whatever its noise
    for race in (race_op, race_from_keys):
        assert int(race(logits, keys)[0]) == 0  # kept: its score is p * 2**25
        assert int(race(filtered, keys)[0]) != 0


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


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return row_keys(torch.randint(0, 2**62, (n,), generator=g),
                    torch.randint(0, 4096, (n,), generator=g))


@pytest.mark.parametrize("rows,vocab", [(64, 49152), (7, 257), (3, 1), (1, 5000)])
def test_race_matches_the_torch_formula(rows, vocab):
    # the kernel skips the softmax's division and computes exp and log with libmvec: only a
    # near-tie closer than a few ulp could go the other way (none in these draws)
    g = torch.Generator().manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3
    keys = _keys(rows)
    got = race_op(logits, keys)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, race_from_keys(logits, keys))


def test_race_never_draws_a_filtered_token():
    logits = torch.full((200, 1000), float("-inf"))
    logits[:, 3] = 0.0
    logits[:, 500] = -200.0  # kept but ~e^-200 of the mass: never drawn either
    logits[100:, 999] = 1.0
    got = race_op(logits, _keys(200))
    assert (got[:100] == 3).all()
    assert set(got[100:].tolist()) <= {3, 999} and len(set(got[100:].tolist())) == 2


def test_race_draws_from_the_softmax():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    got = race_op(probs.log().expand(n, 4).contiguous(), _keys(n, seed=1))
    freq = torch.bincount(got, minlength=4).float() / n
    # binomial sd at n = 20000 is <= 0.0035: 5 sd
    assert torch.allclose(freq, probs, atol=0.018), freq


def test_cpu_race_goes_through_the_kernel():
    seeds, pos = torch.tensor([7, 2**40 + 3]), torch.tensor([0, 11])
    logits = torch.randn(2, 3000)
    assert torch.equal(exponential_race(logits, seeds, pos),
                       race_op(logits, row_keys(seeds, pos)))


@pytest.mark.parametrize("logits,keys,match", [
    (torch.zeros(2, 4, dtype=torch.float64), torch.tensor([1, 2]), "float32"),
    (torch.zeros(3, 4), torch.tensor([1, 2]), r"\[2, V\]"),
    (torch.zeros(2, 0), torch.tensor([1, 2]), "V >= 1"),
    (torch.zeros(4, 2).t(), torch.tensor([1, 2]), "contiguous"),
    (torch.zeros(2, 4), torch.tensor([1, 2**32]), r"\[0, 2\*\*32\)"),
])
def test_race_refuses_bad_arguments(logits, keys, match):
    with pytest.raises(ValueError, match=match):
        race_op(logits, keys)
