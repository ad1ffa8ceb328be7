"""`pdserve::filtered_race` (cpu_kernels/sampling_filter.c) against its definition, the
torch filters of pdserve.engine.device_sampler with the whole row sorted
(`_top_k_top_p_sorted`), min-p (`min_p_filter`) and the race's torch formula; and the CPU
sampler drawing through it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_kernels.sampling_filter import filtered_race
from pdserve.engine.device_sampler import _top_k_top_p_sorted
from pdserve.engine.sampler import min_p_filter, min_p_threshold
from pdserve.engine.sampling_noise import race_from_keys, row_keys

# (temperature, top_k or None for off, top_p, min_p): no filter, top-p alone at the usual
# settings, top-k alone, both, greedy-like top-k 1, a small nucleus; then min-p alone (at
# two temperatures, and at 1: the max and its ties only), with top-k, with top-p (a cut
# before the nucleus ends, and a tiny one after it), with both
SETTINGS = [(1.0, None, 1.0, 0.0), (0.7, None, 0.9, 0.0), (1.0, None, 0.95, 0.0),
            (0.8, 40, 1.0, 0.0), (0.5, 5, 0.8, 0.0), (1.3, 1000, 0.99, 0.0),
            (0.9, 1, 1.0, 0.0), (1.0, None, 0.3, 0.0),
            (1.0, None, 1.0, 0.05), (0.7, None, 1.0, 0.1), (1.0, None, 1.0, 1.0),
            (0.8, 40, 1.0, 0.2), (1.0, None, 0.9, 0.1), (1.0, None, 0.95, 1e-6),
            (0.9, 200, 0.9, 0.05)]


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return row_keys(torch.randint(0, 2**62, (n,), generator=g),
                    torch.randint(0, 4096, (n,), generator=g))


def _params(rows: int, vocab: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    s = [SETTINGS[r % len(SETTINGS)] for r in range(rows)]
    return (torch.tensor([t for t, _, _, _ in s]),
            torch.tensor([min(k or vocab, vocab) for _, k, _, _ in s]),
            torch.tensor([p for _, _, p, _ in s]), torch.tensor([m for _, _, _, m in s]))


def _thresholds(min_p: torch.Tensor) -> torch.Tensor:
    return torch.tensor([min_p_threshold(m) for m in min_p.tolist()])


def _definition(x, t, k, p, min_p, keys):
    y = _top_k_top_p_sorted(x / t[:, None], k, p)
    return race_from_keys(min_p_filter(y, _thresholds(min_p)), keys)


@pytest.mark.parametrize("scale,vocab", [(6.0, 49152), (2.5, 49152), (0.5, 8000), (2.5, 37)])
def test_draws_equal_the_definition(scale, vocab):
    """Peaked rows (a nucleus of a few tokens), middling ones, flat ones (the nucleus runs
    past the candidates: the whole row is sorted), a vocabulary smaller than a bucket's
    worth; banned (-inf) tokens among them."""
    rows = 3 * len(SETTINGS)
    g = torch.Generator().manual_seed(int(scale * 10) + vocab)
    x = torch.randn(rows, vocab, generator=g) * scale
    x[::4, : vocab // 3] = float("-inf")  # every setting has a row with and one without
    t, k, p, min_p = _params(rows, vocab)
    keys = _keys(rows, seed=vocab)
    got = filtered_race(x, t, k, p, min_p, torch.zeros(rows), keys)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, _definition(x, t, k, p, min_p, keys))
    assert not torch.isinf(x.gather(1, got[:, None])).any()


@pytest.mark.parametrize("top_k,top_p", [(None, 1.0), (3, 1.0), (None, 0.9999)])
def test_min_p_cuts_where_the_definition_does(top_k, top_p):
    """Rows of (0, log(min_p), the float below it) over 3,000 values of min_p: the middle
    token's y - max is the threshold itself and stays, the last falls just short, through
    each of the kernel's min-p paths (min-p alone: no buckets; after top-k; after top-p's
    candidates). A threshold an ulp off in either direction would show."""
    n = 3000
    min_p = torch.rand(n, generator=torch.Generator().manual_seed(11)) * 0.95 + 0.05
    thr = _thresholds(min_p)
    x = torch.stack([torch.zeros(n), thr, torch.nextafter(thr, torch.tensor(-torch.inf))], 1)
    x = torch.cat([x, torch.full((n, 5), -30.0)], 1)  # some tokens min-p always drops
    t, k, p = torch.ones(n), torch.full((n,), top_k or 8), torch.full((n,), top_p)
    keys = _keys(n, seed=3)
    got = filtered_race(x, t, k, p, min_p, torch.zeros(n), keys)
    assert torch.equal(got, _definition(x, t, k, p, min_p, keys))
    drawn = torch.bincount(got, minlength=8)
    assert drawn[1] > n // 10 and drawn[2:].sum() == 0, drawn


def test_min_p_one_keeps_the_max_and_its_ties():
    x = torch.randn(1, 500, generator=torch.Generator().manual_seed(2))
    x[0, [30, 300]] = 9.0
    n = 200
    got = filtered_race(x.expand(n, 500).contiguous(), torch.ones(n), torch.full((n,), 500),
                        torch.ones(n), torch.ones(n), torch.zeros(n), _keys(n))
    assert set(got.tolist()) == {30, 300}


def test_ties_at_the_kth_value_are_kept():
    x = torch.full((1, 100), -5.0)
    x[0, [10, 20, 30]] = 2.0
    n = 300
    got = filtered_race(x.expand(n, 100).contiguous(), torch.ones(n), torch.full((n,), 2),
                        torch.ones(n), torch.zeros(n), torch.zeros(n), _keys(n))
    assert set(got.tolist()) == {10, 20, 30}


def test_the_temperature_is_a_division_not_a_reciprocal():
    """Two adjacent floats whose quotients by t are equal, where their products with 1 / t
    are not: top-k 1 keeps both (ties kept) only when the kernel divides, as torch does."""
    t = torch.tensor(1.3)
    a = torch.rand(200000, generator=torch.Generator().manual_seed(1)) + 1.0
    b = torch.nextafter(a, torch.tensor(float("inf")))
    recip = torch.tensor(1.0) / t
    hit = ((a / t) == (b / t)) & ((a * recip) != (b * recip))
    assert hit.any()
    i = int(hit.nonzero()[0])
    n = 400
    x = torch.full((n, 50), -20.0)
    x[:, 3], x[:, 7] = a[i], b[i]
    got = filtered_race(x, t.expand(n).contiguous(), torch.ones(n, dtype=torch.int64),
                        torch.ones(n), torch.zeros(n), torch.zeros(n), _keys(n))
    assert set(got.tolist()) == {3, 7}


def test_draws_follow_the_filtered_distribution():
    """top-p 0.7 over (0.5, 0.25, 0.15, 0.1): the mass before the third token is 0.75, so two
    stay, drawn 2:1; top-k 3 at temperature 2: the first three by p ** 0.5; min-p 0.4
    (a cut at 0.2): two stay, 2:1; min-p 0.5 at temperature 2 (weights p ** 0.5 over the
    max's 0.71: 0.5, 0.39, 0.32 against a cut at 0.35): the first three by p ** 0.5."""
    n = 20000
    x = torch.tensor([0.5, 0.25, 0.15, 0.1]).log().expand(n, 4).contiguous()
    ones, zeros, fours = torch.ones(n), torch.zeros(n), torch.full((n,), 4)
    # binomial sd at n = 20000 is <= 0.0035: 5 sd
    two = torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.double)
    w = torch.tensor([0.5, 0.25, 0.15], dtype=torch.double).sqrt()
    three = torch.cat([w / w.sum(), torch.zeros(1, dtype=torch.double)])
    for i, (t, k, p, min_p, want) in enumerate([
            (ones, fours, torch.full((n,), 0.7), zeros, two),
            (torch.full((n,), 2.0), torch.full((n,), 3), ones, zeros, three),
            (ones, fours, ones, torch.full((n,), 0.4), two),
            (torch.full((n,), 2.0), fours, ones, torch.full((n,), 0.5), three)]):
        got = filtered_race(x, t, k, p, min_p, zeros, _keys(n, seed=1 + i))
        freq = torch.bincount(got, minlength=4).double() / n
        assert torch.allclose(freq, want, atol=0.018), (i, freq)


def test_rows_are_independent_of_their_batch():
    vocab, rows = 5000, 16
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) * 2
    t, k, p, min_p = _params(rows, vocab)
    keys = _keys(rows)
    batch = filtered_race(x, t, k, p, min_p, torch.zeros(rows), keys)
    for r in range(rows):
        one = filtered_race(x[r:r + 1].contiguous(), t[r:r + 1], k[r:r + 1], p[r:r + 1],
                            min_p[r:r + 1], torch.zeros(1), keys[r:r + 1])
        assert int(one[0]) == int(batch[r])


def test_greedy_rows_are_left_alone():
    """A greedy row's parameters are not looked at (its top-k 0 and min-p 2 would be refused
    in a sampled row) and its entry stays 0."""
    x = torch.randn(2, 300)
    x[0, 299] = 50.0  # a sampled row that can only draw 299
    got = filtered_race(x, torch.ones(2), torch.tensor([300, 0]), torch.ones(2),
                        torch.tensor([0.0, 2.0]), torch.tensor([0.0, 1.0]), _keys(2))
    assert got.tolist() == [299, 0]


_X = torch.zeros(2, 8)
_ONES, _K, _0 = torch.ones(2), torch.full((2,), 8), torch.zeros(2)


@pytest.mark.parametrize("args,match", [
    ((_X.double(), _ONES, _K, _ONES, _0, _0, _keys(2)), "float32"),
    ((torch.zeros(4, 2).t(), _ONES, _K, _ONES, _0, _0, _keys(2)), "contiguous"),
    ((torch.zeros(2, 0), _ONES, _K, _ONES, _0, _0, _keys(2)), "V >= 1"),
    ((_X, torch.ones(3), _K, _ONES, _0, _0, _keys(2)), "temperature"),
    ((_X, _ONES, _K.int(), _ONES, _0, _0, _keys(2)), "top_k"),
    ((_X, _ONES, _K, _ONES, _0.double(), _0, _keys(2)), "min_p"),
    ((_X, _ONES, _K, _ONES, torch.zeros(4)[::2], _0, _keys(2)), "min_p"),
    ((_X, _ONES, _K, _ONES, _0, _0, _keys(2).float()), "keys"),
    ((_X, _ONES, torch.tensor([8, 9]), _ONES, _0, _0, _keys(2)), "out of range"),
    ((_X, _ONES, torch.tensor([0, 8]), _ONES, _0, _0, _keys(2)), "out of range"),
    ((_X, torch.tensor([1.0, 0.0]), _K, _ONES, _0, _0, _keys(2)), "out of range"),
    ((_X, _ONES, _K, torch.tensor([1.0, 0.0]), _0, _0, _keys(2)), "out of range"),
    ((_X, _ONES, _K, torch.tensor([1.5, 1.0]), _0, _0, _keys(2)), "out of range"),
    ((_X, _ONES, _K, _ONES, torch.tensor([0.0, 1.5]), _0, _keys(2)), r"min_p in \[0, 1\]"),
    ((_X, _ONES, _K, _ONES, torch.tensor([-0.1, 0.0]), _0, _keys(2)), "out of range"),
    ((_X, _ONES, _K, _ONES, _0, _0, torch.tensor([1, 2**32])), "out of range"),
])
def test_bad_arguments_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        filtered_race(*args)


def test_the_cpu_sampler_draws_through_the_filter(monkeypatch):
    """sample_on_device's tokens with the C filter equal those of its torch stages, for a
    batch mixing greedy (one with a min-p it ignores), plain, top-p, top-k and min-p rows
    (alone, at a temperature, with top-p, with top-k, with both)."""
    import pdserve.engine.device_sampler as ds
    from pdserve.engine.sampler import SampleRow
    from pdserve.protocol import SamplingParams

    vocab = 49152
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.7, top_p=0.9, seed=2),
              SamplingParams(temperature=0.8, top_k=40, seed=3),
              SamplingParams(temperature=1.0, top_p=0.95, top_k=200, seed=4),
              SamplingParams(temperature=1.0, min_p=0.05, seed=5),
              SamplingParams(temperature=0.6, min_p=0.2, seed=6),
              SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1, seed=7),
              SamplingParams(temperature=0.9, top_k=100, min_p=0.02, seed=8),
              SamplingParams(temperature=1.1, top_k=500, top_p=0.95, min_p=0.01, seed=9),
              SamplingParams(temperature=0.0, min_p=0.5)]
    rows = [SampleRow(p, [1, 2, 3], [5] * i, (2,)) for i, p in enumerate(params)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(9)) * 3
    bufs = ds.SamplingBuffers(16, vocab, torch.device("cpu"))
    calls = []
    real = ds._cpu_filter()
    assert real is not None
    monkeypatch.setattr(ds, "_cpu_filter", lambda: lambda *a: calls.append(1) or real(*a))
    flags = bufs.fill(rows, len(rows))
    assert flags.min_p
    got = ds.sample_on_device(logits, bufs, flags)[:, 0]
    assert calls
    monkeypatch.setattr(ds, "_cpu_filter", lambda: None)
    want = ds.sample_on_device(logits, bufs, bufs.fill(rows, len(rows)))[:, 0]
    assert torch.equal(got, want)
    assert int(got[0]) == int(logits[0].argmax()) and int(got[-1]) == int(logits[-1].argmax())
