"""The C greedy argmax (cpu_kernels/argmax.c) against torch.argmax(-1): ties, NaNs, -inf
rows, short rows and the vector tail, strided rows; and the device sampler's greedy
tokens go through it on the CPU."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_kernels.argmax import argmax_rows
from pdserve.engine.device_sampler import _cpu_argmax, greedy_tokens


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (5, 16), (4, 17), (64, 49152),
                                        (2, 100003)])
def test_matches_torch_on_random_rows(rows, vocab):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_ties_nans_and_infinities_answer_as_torch_does():
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    x[0, 5] = x[0, 900] = 50.0           # a tie: the first index
    x[1, 700] = float("nan")             # a NaN beats every number
    x[2, 3] = x[2, 999] = float("nan")   # the first NaN
    x[3] = float("-inf")                 # nothing allowed: index 0
    x[4, 998] = float("inf")             # +inf in the tail
    x[5, :] = 2.0                        # all equal
    x[6, 999] = 60.0                     # the last element, past the vector loop
    x[7, 0] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_strided_rows_and_empty_batches():
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    view = x[::2, :250]  # row stride 600 elements, rows contiguous
    assert torch.equal(argmax_rows(view), view.argmax(-1))
    assert argmax_rows(torch.zeros(0, 5)).shape == (0,)


@pytest.mark.parametrize("x,match", [
    (torch.zeros(2, 4, dtype=torch.float64), "float32"),
    (torch.zeros(4), r"\[R, V\]"),
    (torch.zeros(2, 0), "V >= 1"),
    (torch.zeros(4, 2).t(), "contiguous"),
])
def test_bad_arguments_are_refused(x, match):
    with pytest.raises(ValueError, match=match):
        argmax_rows(x)


def test_the_sampler_uses_the_kernel_on_the_cpu():
    assert _cpu_argmax() is argmax_rows
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy_tokens(x), x.argmax(-1))
    # a column view (rows not contiguous) and other dtypes fall back to torch
    col = torch.randn(50, 4).t()
    assert torch.equal(greedy_tokens(col), col.argmax(-1))
    assert torch.equal(greedy_tokens(x.double()), x.double().argmax(-1))
