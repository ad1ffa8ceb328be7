"""The `cpu` backend's paged decode and prefill kernels against the torch references, their
input checks, the backend on mixed steps, its selection by `auto`, and engine-level greedy
parity."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_pool_clean, tiny_engine

from pdserve.engine.attention.cpu_backend import CpuAttentionBackend
from pdserve.engine.attention.torch_backend import (
    TorchAttentionBackend,
    decode_attention_reference,
    prefill_attention_reference,
)
from pdserve.engine.cpu_kernels import build
from pdserve.engine.cpu_kernels.build import KernelBuildError
from pdserve.engine.cpu_kernels.paged_decode import paged_decode_attention
from pdserve.engine.cpu_kernels.paged_prefill import paged_prefill_attention
from pdserve.engine.layers import registry
from pdserve.engine.layers.attention import AttentionMetadata
from pdserve.engine.layers.registry import get_backend
from pdserve.protocol import SamplingParams

PAD = -7  # table entries past a sequence's blocks: never read, so never checked


def _tables(lens: list[int], bs: int, gen: torch.Generator, spare: int = 2):
    """Block tables over shuffled blocks of one pool, one spare column of padding."""
    need = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(need) + spare  # a few blocks nobody uses
    ids = torch.randperm(num_blocks, generator=gen).int()
    tables = torch.full((len(lens), max(need) + 1), PAD, dtype=torch.int32)
    at = 0
    for row, n in enumerate(need):
        tables[row, :n] = ids[at:at + n]
        at += n
    return tables, num_blocks


def _inputs(lens, bs, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _tables(lens, bs, gen)
    k = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    return q, k, v, torch.tensor(lens, dtype=torch.int32), tables


def _ref(q, k, v, lens, tables, scale, dtype=None):
    # the reference reads only the first ceil(len / bs) columns, but its plan indexes the
    # padded ones too: give it in-range padding
    t = tables.clamp(min=0)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return decode_attention_reference(q, k, v, lens, t, scale)


@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])  # GQA ratios 1, 3, 8
def test_kernel_matches_reference(bs, d, hq, hkv):
    # block edges, several blocks, and short next to long in one batch
    lens = [1, bs - 1, bs, bs + 1, 7 * bs + 3, 2, 5 * bs]
    scale = d ** -0.5
    q, k, v, sl, tables = _inputs(lens, bs, hq, hkv, d, torch.float32)
    out = paged_decode_attention(q, k, v, sl, tables, scale)
    # float32: same math in float32, only the summation order and a vectorised exp2 differ
    # (a few ulp on values of order 1)
    torch.testing.assert_close(out, _ref(q, k, v, sl, tables, scale), atol=1e-5, rtol=1e-5)

    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = paged_decode_attention(qb, kb, vb, sl, tables, scale)
    assert out.dtype == torch.bfloat16
    # bfloat16 in, float32 math, one rounding at the end: against float32 math on the same
    # bf16 values the error is that rounding, half a bf16 ulp (2^-9 relative). With
    # AVX512-BF16, q.k is vdpbf16ps: bf16 * bf16 products are exact in float32 and summed in
    # float32, so the same holds (>= 99.9% of outputs equal the correctly rounded value, as
    # with the float32-only paths)
    exact = _ref(qb, kb, vb, sl, tables, scale, torch.float32)
    torch.testing.assert_close(out.float(), exact, atol=1e-3, rtol=2 ** -8)
    # the bf16 reference rounds intermediates too, so it sits a few bf16 ulp away
    torch.testing.assert_close(out.float(), _ref(qb, kb, vb, sl, tables, scale).float(),
                               atol=3e-2, rtol=3e-2)


def test_peaked_scores_match_reference():
    # A query 40x its usual size makes score gaps of hundreds in log2 units: the softmax
    # weights of most keys are below 2^-126 and the kernels clamp them to exactly 0 rather
    # than let the vector exp2 fall back to scalar code (common.h); the result must still
    # be the reference's, for decode and for prefill (whose masked scores are -1e30)
    bs, d, hq, hkv = 16, 64, 6, 2
    lens = [1, 17, 5 * bs + 3]
    q, k, v, sl, tables = _inputs(lens, bs, hq, hkv, d, torch.float32, seed=3)
    q = q * 40
    out = paged_decode_attention(q, k, v, sl, tables, d ** -0.5)
    torch.testing.assert_close(out, _ref(q, k, v, sl, tables, d ** -0.5), atol=1e-5, rtol=1e-5)
    chunks = [(bs + 1, bs + 1), (5, 3 * bs + 3)]
    q, k, v, tables = _prefill_inputs(chunks, bs, hq, hkv, d, seed=4)
    q = q * 40
    out = paged_prefill_attention(q, k, v, [c for c, _ in chunks], [s for _, s in chunks],
                                  tables, d ** -0.5)
    # scores of a few hundred carry float32 rounding of ~1e-5 into the exponent, in the
    # reference as in the kernel: the tolerance follows (the same 4e-5 before the clamp)
    torch.testing.assert_close(out, _prefill_ref(q, k, v, chunks, tables, d ** -0.5),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lens", [[1000], [2000, 5, 17], [900, 880, 910]],
                         ids=["one-alone", "one-long-two-short", "three-alike"])
def test_sequences_split_in_token_ranges(lens):
    """A call splits a sequence longer than a quarter of its tokens (and than 512) into ranges
    of that many tokens whose softmax states are merged: against the reference in float32,
    bfloat16 and a float32 query over a bfloat16 cache, and the same bits from teams of one,
    two and three threads (the split follows the lengths)."""
    bs, d, hq, hkv = 16, 64, 9, 3  # SmolLM2's heads
    scale = d ** -0.5
    q, k, v, sl, tables = _inputs(lens, bs, hq, hkv, d, torch.float32, seed=5)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append((paged_decode_attention(q, k, v, sl, tables, scale),
                         paged_decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), sl,
                                                tables, scale),
                         paged_decode_attention(q, k.bfloat16(), v.bfloat16(), sl, tables,
                                                scale)))
    finally:
        torch.set_num_threads(threads)
    (out, out_b, out_m), rest = outs[0], outs[1:]
    for o, ob, om in rest:
        assert torch.equal(o, out) and torch.equal(ob, out_b) and torch.equal(om, out_m)
    assert out_m.dtype == torch.float32
    torch.testing.assert_close(out_m, _ref(q, k.bfloat16().float(), v.bfloat16().float(), sl,
                                           tables, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _ref(q, k, v, sl, tables, scale), atol=1e-5, rtol=1e-5)
    exact = _ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), sl, tables, scale, torch.float32)
    torch.testing.assert_close(out_b.float(), exact, atol=1e-3, rtol=2 ** -8)


def test_strided_query_out_and_mixed_dtypes():
    lens = [3, 40, 17]
    q, k, v, sl, tables = _inputs(lens, 16, 6, 2, 64, torch.float32, seed=1)
    # the model hands over q as a slice of its fused q/k projection: a batch stride
    fused = torch.randn(3, 8, 64)
    fused[:, :6] = q
    out = torch.full((3, 6, 64), float("nan"))
    assert paged_decode_attention(fused[:, :6], k, v, sl, tables, 0.125, out=out) is out
    ref = _ref(q, k, v, sl, tables, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # float32 query over a bf16 cache: output in the query's dtype
    kb, vb = k.bfloat16(), v.bfloat16()
    out = paged_decode_attention(q, kb, vb, sl, tables, 0.125)
    assert out.dtype == torch.float32
    exact = _ref(q, kb.float(), vb.float(), sl, tables, 0.125)
    torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-5)


def test_large_head_dim_and_odd_shapes():
    # head_dim 256 (the maximum), ones not a multiple of 16 or of 8 (the portable steps'
    # vector tails), block size 5
    for d, bs in ((256, 16), (40, 5), (36, 16)):
        q, k, v, sl, tables = _inputs([1, 9, 33], bs, 4, 2, d, torch.float32, seed=d)
        torch.testing.assert_close(paged_decode_attention(q, k, v, sl, tables, 0.1),
                                   _ref(q, k, v, sl, tables, 0.1), atol=1e-5, rtol=1e-5)
        qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
        torch.testing.assert_close(paged_decode_attention(qb, kb, vb, sl, tables, 0.1).float(),
                                   _ref(qb, kb, vb, sl, tables, 0.1, torch.float32),
                                   atol=1e-3, rtol=2 ** -8)


def _bad_inputs():
    q, k, v, sl, tables = _inputs([5, 20], 16, 4, 2, 64, torch.float32)
    n = k.shape[0]
    oob = tables.clone()
    oob[1, 1] = n  # the second block of a 20-token sequence
    neg = tables.clone()
    neg[0, 0] = -1
    ok = dict(query=q, k_cache=k, v_cache=v, seq_lens=sl, block_tables=tables, scale=0.125)
    return [
        (dict(ok, query=q.half()), "query dtype"),
        (dict(ok, k_cache=k.double(), v_cache=v.double()), "k_cache dtype"),
        (dict(ok, seq_lens=sl.long()), "seq_lens"),
        (dict(ok, block_tables=tables.long()), "block_tables"),
        (dict(ok, query=q[:, :, :32]), "head_dim"),
        (dict(ok, query=q[:, :3]), "multiple"),
        (dict(ok, query=q[:1]), "seq_lens"),
        (dict(ok, v_cache=v[:-1]), "v_cache must match"),
        (dict(ok, k_cache=k.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (dict(ok, block_tables=oob), f"block id {n}"),
        (dict(ok, block_tables=neg), "block id -1"),
        # 3 table columns of 16: 48 tokens at most
        (dict(ok, seq_lens=torch.tensor([5, 49], dtype=torch.int32)), r"seq_lens\[1\] = 49"),
        (dict(ok, seq_lens=torch.tensor([0, 20], dtype=torch.int32)), r"seq_lens\[0\] = 0"),
        (dict(ok, out=torch.empty(2, 4, 64, dtype=torch.bfloat16)), "out must be"),
    ]


@pytest.mark.parametrize("kwargs,match", _bad_inputs())
def test_bad_input_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**kwargs)


def _prefill_inputs(chunks, bs, hq, hkv, d, seed=0):
    """(query_len, seq_len) per chunk: float32 query rows, caches and tables."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _tables([s for _, s in chunks], bs, gen)
    k = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    v = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    q = torch.randn(sum(c for c, _ in chunks), hq, d, generator=gen)
    return q, k, v, tables


def _prefill_ref(q, k, v, chunks, tables, scale):
    starts = [0]
    for c, _ in chunks:
        starts.append(starts[-1] + c)
    return prefill_attention_reference(q, k, v, starts, [s for _, s in chunks],
                                       tables.clamp(min=0), scale)


@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])  # GQA ratios 1, 3, 8
def test_prefill_kernel_matches_reference(bs, d, hq, hkv):
    # (query_len, seq_len): fresh prompts at block edges, chunks over a cached prefix that
    # ends mid-block, and a chunk longer than one tile of query tokens (64 // G)
    chunks = [(1, 1), (bs - 1, bs - 1), (bs, bs), (bs + 1, bs + 1), (5, 7 * bs + 3),
              (3 * bs + 2, 5 * bs), (70, 70)]
    q, k, v, tables = _prefill_inputs(chunks, bs, hq, hkv, d, seed=bs + d + hq)
    scale = d ** -0.5
    qlens, lens = [c for c, _ in chunks], [s for _, s in chunks]
    out = paged_prefill_attention(q, k, v, qlens, lens, tables, scale)
    # float32 throughout; only summation order and the vectorised exp2 differ
    torch.testing.assert_close(out, _prefill_ref(q, k, v, chunks, tables, scale),
                               atol=1e-5, rtol=1e-5)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = paged_prefill_attention(qb, kb, vb, qlens, lens, tables, scale)
    assert out.dtype == torch.bfloat16
    # bf16 values widened exactly, float32 math, one rounding at the end: half a bf16 ulp
    # from float32 math on the same values (see test_kernel_matches_reference)
    exact = _prefill_ref(qb.float(), kb.float(), vb.float(), chunks, tables, scale)
    torch.testing.assert_close(out.float(), exact, atol=1e-3, rtol=2 ** -8)


def test_prefill_kernel_strided_query_out_and_mixed_dtypes():
    chunks = [(20, 20), (9, 40)]
    q, k, v, tables = _prefill_inputs(chunks, 16, 6, 2, 64, seed=3)
    fused = torch.randn(29, 10, 64)  # q as a slice of fused QKV rows: a token stride
    fused[:, :6] = q
    out = torch.full((29, 6, 64), float("nan"))
    got = paged_prefill_attention(fused[:, :6], k, v, [20, 9], [20, 40], tables, 0.125,
                                  out=out)
    assert got is out
    ref = _prefill_ref(q, k, v, chunks, tables, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    kb, vb = k.bfloat16(), v.bfloat16()  # float32 query over a bf16 cache
    out = paged_prefill_attention(q, kb, vb, [20, 9], [20, 40], tables, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _prefill_ref(q, kb.float(), vb.float(), chunks, tables,
                                                 0.125), atol=1e-5, rtol=1e-5)


def _bad_prefill_inputs():
    q, k, v, tables = _prefill_inputs([(5, 5), (4, 20)], 16, 4, 2, 64)
    n = k.shape[0]
    oob = tables.clone()
    oob[1, 1] = n
    ok = dict(query=q, k_cache=k, v_cache=v, query_lens=[5, 4], seq_lens=[5, 20],
              block_tables=tables, scale=0.125)
    return [
        (dict(ok, query=q[:, :, :40].contiguous(), k_cache=k[..., :40].contiguous(),
              v_cache=v[..., :40].contiguous()), "multiple of 16"),
        (dict(ok, query_lens=[5, 3]), "sum to 8, not the 9"),
        (dict(ok, query_lens=[5, 4], seq_lens=[5, 3]), "query length 4 must be in 1..seq_len"),
        (dict(ok, query_lens=[0, 9], seq_lens=[5, 20]), "query length 0"),
        (dict(ok, block_tables=oob), f"block id {n}"),
        (dict(ok, seq_lens=[5, 49]), r"seq_lens\[1\] = 49"),
        (dict(ok, block_tables=tables[:1]), "block_tables"),
        (dict(ok, query=q.half()), "query dtype"),
    ]


@pytest.mark.parametrize("kwargs,match", _bad_prefill_inputs())
def test_prefill_bad_input_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(**kwargs)


def _step(seqs: list[tuple[int, int]], num_decodes: int, bs: int, gen: torch.Generator):
    """AttentionMetadata for (query_len, seq_len) per sequence, on shuffled blocks."""
    tables, num_blocks = _tables([s for _, s in seqs], bs, gen)
    tables = tables.clamp(min=0)  # as the engine pads
    slots, starts = [], [0]
    for row, (q, s) in enumerate(seqs):
        pos = torch.arange(s - q, s)
        slots.append(tables[row, pos // bs].long() * bs + pos % bs)
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        num_decodes=num_decodes, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.cat(slots), max_query_len=max(q for q, _ in seqs),
        max_seq_len=max(s for _, s in seqs), query_lens_cpu=[q for q, _ in seqs],
        seq_lens_cpu=[s for _, s in seqs])
    return meta, num_blocks


def _cpu_vs_torch_backend(seqs, num_decodes, dtype, atol, d=64):
    """Runs one step through both backends and asserts their outputs agree."""
    gen = torch.Generator().manual_seed(0)
    meta, num_blocks = _step(seqs, num_decodes, 16, gen)
    t = len(meta.slot_mapping)
    k_cache = torch.randn(num_blocks, 16, 2, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, 16, 2, d, generator=gen).to(dtype)
    kv = torch.randn(2, t, 2, d, generator=gen).to(dtype)
    query = torch.randn(t, 6, d, generator=gen).to(dtype)
    outs = []
    for be in (TorchAttentionBackend(), CpuAttentionBackend()):
        kc, vc = k_cache.clone(), v_cache.clone()
        be.store_kv(kv[0], kv[1], kc, vc, meta.slot_mapping)
        outs.append(be.forward(query, kc, vc, meta, 0.125))
    assert outs[1].shape == query.shape and outs[1].dtype == dtype
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("seqs,num_decodes,dtype,atol", [
    ([(1, 1), (1, 16), (1, 17), (1, 90), (20, 20), (7, 40), (16, 33)], 4, torch.float32, 1e-5),
    ([(1, 5), (1, 70)], 2, torch.float32, 1e-5),  # decode-only step
    ([(9, 9), (30, 64)], 0, torch.float32, 1e-5),  # prefill-only step
    ([(1, 40), (1, 513), (9, 9), (30, 530), (5, 21)], 2, torch.float32, 1e-5),
    # bf16: see test_kernel_matches_reference
    ([(1, 33), (12, 50), (40, 600), (70, 700)], 1, torch.bfloat16, 3e-2),
])
def test_backend_matches_torch_backend(seqs, num_decodes, dtype, atol):
    _cpu_vs_torch_backend(seqs, num_decodes, dtype, atol)


def test_backend_head_dim_the_prefill_kernel_lacks(monkeypatch):
    # head_dim 40: the decode kernel takes it, the prefill chunks go to the torch reference
    def refuse(*args, **kwargs):
        raise AssertionError("the prefill kernel was called for head_dim 40")

    monkeypatch.setattr("pdserve.engine.attention.cpu_backend.paged_prefill_attention", refuse)
    _cpu_vs_torch_backend([(1, 30), (300, 300)], 1, torch.float32, 1e-5, d=40)


def test_auto_picks_cpu_and_falls_back_to_torch(monkeypatch, caplog):
    assert isinstance(get_backend("cpu"), CpuAttentionBackend)
    assert isinstance(get_backend("auto", "cpu"), CpuAttentionBackend)

    def broken():
        raise KernelBuildError("no C compiler found")

    monkeypatch.setattr("pdserve.engine.attention.cpu_backend.load", broken)
    monkeypatch.setattr(registry, "_warned", set())
    with caplog.at_level(logging.WARNING):
        assert isinstance(get_backend("auto", "cpu"), TorchAttentionBackend)
        assert isinstance(get_backend("auto", "cpu"), TorchAttentionBackend)
    assert [r.getMessage() for r in caplog.records].count(
        "cpu attention kernels unavailable (no C compiler found); using the `torch` attention "
        "backend") == 1
    with pytest.raises(KernelBuildError):
        get_backend("cpu")  # asked for by name: the error, not a silent fallback


def test_build_cache_location_and_failure(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "k"))
    assert build.library_path("gcc").parent == tmp_path / "k"
    # a different compiler is a different binary
    assert build.library_path("gcc") != build.library_path("clang")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KernelBuildError, match="could not build"):
        build.build()
    assert not any((tmp_path / "k").iterdir())  # no temp file left behind


def test_a_failed_build_says_why_in_one_line(tmp_path):
    # the real compiler, given a target it does not know: the one-line message that
    # `make` and the server's warning print must carry the compiler's own error
    env = dict(os.environ, PDSERVE_KERNEL_CACHE=str(tmp_path / "k"),
               PDSERVE_KERNEL_MARCH="no-such-cpu")
    r = subprocess.run([sys.executable, "-m", "pdserve.engine.cpu_kernels.build"], env=env,
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("pdserve: CPU kernels not built:")
    assert "error" in line and "no-such-cpu" in line


# bfloat16 KV cache under the float32 model: the kernels' mixed-dtype paths
@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_engine_greedy_cpu_equals_torch(tiny_model_dir, kv_dtype):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 5000 + 10 for j in range(n)]
               for i, n in enumerate((5, 16, 17, 40, 90, 150))]
    outs = {}
    for name in ("torch", "cpu"):
        # a small step budget chunks the longer prompts, so decodes and prefill chunks mix
        eng = tiny_engine(tiny_model_dir, attention_backend=name, max_num_batched_tokens=64,
                          kv_cache_dtype=kv_dtype)
        assert eng.kv_cache.key(0).dtype == (torch.bfloat16 if kv_dtype else torch.float32)
        assert eng.runner.backend.name == name
        outs[name] = [o.token_ids for o in eng.generate(prompts, params)]
        assert_pool_clean(eng)
    assert outs["cpu"] == outs["torch"]
