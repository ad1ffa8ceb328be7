"""The Triton kernels of engine/kernels against their torch references (CPU, interpreter).

Sizes are tiny: the interpreter runs every program instance in Python. The grid of cases
is sparse on purpose — each row varies several axes (block size, head dim, GQA ratio,
dtype, lengths around block boundaries, split-K) instead of taking their product.

Tolerances: fp32 runs with ieee dots, so only summation order differs from SDPA (~1e-6).
16-bit cases compare against the fp32 reference on the *same* 16-bit cache values, so the
only error is the kernel's own rounding: softmax weights cast to the cache dtype before
the PV dot and the output cast once — a few units of that dtype's epsilon.
"""


import pytest
import torch
import triton
import triton.language as tl

from pdserve.engine.attention.torch_backend import (
    decode_attention_reference,
    prefill_attention_reference,
    store_kv_reference,
)
from pdserve.engine.kernels.common import interpreted, paged_offsets
from pdserve.engine.kernels.paged_decode_attention import paged_decode_attention, use_split_k
from pdserve.engine.kernels.prefill_attention import prefill_attention
from pdserve.engine.kernels.store_kv import store_kv

pytestmark = pytest.mark.skipif(not interpreted() and not torch.cuda.is_available(),
                                reason="kernels were compiled for a GPU and there is none")

DEV = "cuda" if not interpreted() else "cpu"  # scripts/gpu_check.py runs this file compiled
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: {"atol": 2e-5, "rtol": 1e-5}, F16: {"atol": 4e-3, "rtol": 4e-3},
       BF16: {"atol": 3e-2, "rtol": 3e-2}}
# Real sizes when run compiled on a GPU (scripts/gpu_check.py); tiny under the interpreter.
SCALE_UP = 1 if interpreted() else 16


def _cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return k.to(DEV), v.to(DEV)


def _block_tables(seq_lens, block_size, num_blocks, gen, first_block=0):
    """Shuffled, non-contiguous block ids; one padding column past the longest sequence."""
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    ids = first_block + torch.randperm(num_blocks - first_block, generator=gen)[:sum(need)]
    table = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32)
    at = 0
    for row, n in enumerate(need):
        table[row, :n] = ids[at:at + n]
        at += n
    return table.to(DEV)


def _f32(*ts):
    # References run on the CPU in fp32: prefill_attention_reference builds its mask on the
    # CPU, and fp32 makes them the truth for 16-bit caches.
    return [t.float().cpu() for t in ts]


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("block_size,head_dim,kv_heads,dtype,num_tokens", [
    (8, 64, 1, F32, 5),
    (16, 128, 2, F16, 33),
    (32, 64, 3, BF16, 40),
])
def test_store_kv_matches_reference(block_size, head_dim, kv_heads, dtype, num_tokens):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 12
    k_cache, v_cache = _cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    # key/value as views of one fused projection: strided tokens, as the model hands them.
    kv = torch.randn(num_tokens, 2, kv_heads, head_dim, generator=gen).to(dtype).to(DEV)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # skipped tokens
    slots = slots.to(DEV)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy: exact


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("block_size,head_dim,group,seq_lens,split_k,dtype", [
    (8, 64, 1, [1, 7, 8, 9, 40], False, F32),
    (16, 128, 3, [1, 15, 16, 17, 70], True, F32),
    (32, 64, 8, [1, 31, 32, 33, 130], True, F32),
    (8, 128, 1, [2, 200], None, F32),  # heuristic: batch 2 x 2 kv heads, long -> split
    (16, 64, 8, [3, 100], False, F16),
    (16, 64, 3, [5, 90], True, BF16),
])
def test_decode_matches_reference(block_size, head_dim, group, seq_lens, split_k, dtype):
    gen = torch.Generator().manual_seed(1)
    kv_heads = 2
    seq_lens = [n * SCALE_UP for n in seq_lens]
    num_blocks = sum(n // block_size + 1 for n in seq_lens) + 7
    k_cache, v_cache = _cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    tables = _block_tables(seq_lens, block_size, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    query = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    query = query.to(DEV)
    scale = head_dim ** -0.5
    # partition_size 32: several partitions (and empty ones for short rows) at tiny sizes.
    out = paged_decode_attention(query=query, k_cache=k_cache, v_cache=v_cache, seq_lens=lens,
                                 block_tables=tables, scale=scale, split_k=split_k,
                                 partition_size=32 * SCALE_UP, tile_n=16)
    q32, k32, v32 = _f32(query, k_cache, v_cache)
    ref = decode_attention_reference(q32, k32, v32, lens.cpu(), tables.cpu(), scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref, **TOL[dtype])


@pytest.mark.parametrize("batch,kv_heads,ctx,split", [
    # Few programs and long contexts -> split; a full grid or short contexts -> not. The
    # H200 timings behind each row (us, split vs not) are in docs/gpu_report.json.
    (1, 8, 8192, True),  # 117 vs 217
    (8, 8, 4096, True),  # 55 vs 118
    (64, 3, 2048, True),  # SmolLM2's shape: 56 vs 63
    (32, 8, 1024, False),  # two partitions do not pay for the reduce: 63 vs 49
    (64, 8, 2048, False),  # 512 programs fill the GPU: 206 vs 137
    (256, 8, 512, False),
    (1, 8, 300, False),
])
def test_split_k_heuristic(batch, kv_heads, ctx, split):
    assert use_split_k(batch_size=batch, num_kv_heads=kv_heads, max_seq_len=ctx,
                       num_sms=132) is split


# ---------------------------------------------------------------- prefill


@pytest.mark.parametrize("block_size,head_dim,group,chunks,dtype,block_mn", [
    # chunks: (query_len, seq_len); seq_len > query_len means a cached prefix.
    # block_mn (block_m, block_n) rows: the query tile packs `group` heads per position,
    # so block_m 16 with group 3 is 5 positions and a padding row, group 8 is 2 positions.
    (8, 64, 1, [(1, 1), (7, 7), (8, 8), (9, 9)], F32, (16, 16)),
    (16, 128, 3, [(5, 40), (17, 17), (1, 16), (16, 33)], F32, (16, 16)),
    (32, 64, 8, [(40, 100), (33, 33)], F32, (32, 32)),
    (16, 64, 3, [(20, 50), (2, 2)], F16, (16, 16)),
    (8, 64, 1, [(20, 50), (3, 3)], BF16, (16, 16)),
    # group 24 > block_m 16: raised to 32 rows, one position each, 8 padding rows.
    (8, 64, 24, [(9, 30), (4, 4)], F32, (16, 16)),
    # head_dim 80 pads to 128 (masked head_dim); launcher defaults (128 x 64 tiles).
    (16, 80, 3, [(50, 120), (70, 70), (1, 9)], BF16, None),
    # block_n 32 < block_size 64: tiles inside one block; block_m 64 / group 4 = 16 rows.
    (64, 64, 4, [(45, 200), (64, 64)], F16, (64, 32)),
])
def test_prefill_matches_reference(block_size, head_dim, group, chunks, dtype, block_mn):
    gen = torch.Generator().manual_seed(2)
    kv_heads = 2
    q_lens = [q * SCALE_UP for q, _ in chunks]
    seq_lens = [s * SCALE_UP for _, s in chunks]
    num_blocks = sum(n // block_size + 1 for n in seq_lens) + 5
    k_cache, v_cache = _cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    tables = _block_tables(seq_lens, block_size, num_blocks, gen)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    query = torch.randn(cu[-1], kv_heads * group, head_dim, generator=gen).to(dtype).to(DEV)
    scale = head_dim ** -0.5
    out = prefill_attention(
        query=query, k_cache=k_cache, v_cache=v_cache,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=tables, scale=scale,
        **({} if block_mn is None else {"block_m": block_mn[0], "block_n": block_mn[1]}))
    q32, k32, v32 = _f32(query, k_cache, v_cache)
    ref = prefill_attention_reference(q32, k32, v32, cu, seq_lens, tables.cpu(), scale)
    torch.testing.assert_close(out.float().cpu(), ref, **TOL[dtype])


def test_prefill_accepts_offset_cu_seqlens():
    # A slice of a mixed batch's query_start_loc starts past 0 (after the decodes).
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = _cache(10, 16, 1, 64, F32, gen)
    tables = _block_tables([20, 9], 16, 10, gen)
    query = torch.randn(12, 2, 64, generator=gen).to(DEV)
    args = {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
            "seq_lens": torch.tensor([20, 9], dtype=torch.int32, device=DEV), "scale": 0.125,
            "block_m": 16, "block_n": 16}
    a = prefill_attention(cu_seqlens=torch.tensor([0, 3, 12], device=DEV), **args)
    b = prefill_attention(cu_seqlens=torch.tensor([5, 8, 17], device=DEV), **args)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------- int64 indexing


@triton.jit
def _offsets_probe(table_ptr, out_ptr, stride_block, N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    pos = tl.arange(0, N) * BLOCK_SIZE
    offs = paged_offsets(table_ptr, pos, pos >= 0, tl.program_id(0), tl.arange(0, 1),
                         stride_block, 1, 0, BLOCK_SIZE)
    tl.store(out_ptr + tl.arange(0, N)[:, None], offs)


def test_paged_offsets_are_int64():
    # A cache past 2**31 elements does not fit this machine's RAM, so the arithmetic every
    # kernel shares is probed directly: block ids near 2**17 times a block stride of 2**16
    # (a 16 x 8 x 512 block) is ~2**33, which int32 math would wrap. The interpreter
    # computes in numpy with the kernel's dtypes, so a missing cast shows up here.
    table = torch.tensor([2**17 - 1, 2**17 - 2, 5, 0], dtype=torch.int32, device=DEV)
    out = torch.zeros(4, 1, dtype=torch.int64, device=DEV)
    _offsets_probe[(1,)](table, out, 2**16, N=4, BLOCK_SIZE=16)
    assert out[:, 0].tolist() == [int(b) * 2**16 for b in table.tolist()]


def test_top_blocks_of_a_large_cache():
    # The end-to-end half: a big-in-num_blocks, tiny-otherwise cache (2**16 blocks, 34 MB
    # fp16 each for K and V) with every block id near the top; store, decode and prefill
    # must agree with the references there.
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, head_dim = 2**16, 8, 64
    k_cache = torch.zeros(num_blocks, block_size, 1, head_dim, dtype=F16, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    seq_lens = [13, 20]
    tables = _block_tables(seq_lens, block_size, num_blocks, gen, first_block=num_blocks - 8)
    slots = torch.cat([
        (tables.cpu()[i, torch.arange(n) // block_size].long() * block_size
         + torch.arange(n) % block_size)
        for i, n in enumerate(seq_lens)]).to(DEV)
    key = torch.randn(len(slots), 1, head_dim, generator=gen).to(F16).to(DEV)
    value = torch.randn(len(slots), 1, head_dim, generator=gen).to(F16).to(DEV)
    store_kv(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    top = slice(num_blocks - 8, None)
    k_ref, v_ref = k_cache[top].clone().zero_(), v_cache[top].clone().zero_()
    store_kv_reference(key, value, k_ref, v_ref, slots - (num_blocks - 8) * block_size)
    assert torch.equal(k_cache[top], k_ref) and torch.equal(v_cache[top], v_ref)

    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(2, 2, head_dim, generator=gen).to(F16).to(DEV)
    out = paged_decode_attention(query=q, k_cache=k_cache, v_cache=v_cache, seq_lens=lens,
                                 block_tables=tables, scale=0.125, split_k=True,
                                 partition_size=16, tile_n=16)
    q32, k32, v32 = _f32(q, k_cache[top], v_cache[top])
    local = (tables - (num_blocks - 8)).clamp(min=0).cpu()  # padding is 0, not a top id
    ref = decode_attention_reference(q32, k32, v32, lens.cpu(), local, 0.125)
    torch.testing.assert_close(out.float().cpu(), ref, **TOL[F16])

    qp = torch.randn(sum(seq_lens), 2, head_dim, generator=gen).to(F16).to(DEV)
    cu = [0, seq_lens[0], sum(seq_lens)]
    out = prefill_attention(query=qp, k_cache=k_cache, v_cache=v_cache,
                            cu_seqlens=torch.tensor(cu, device=DEV), seq_lens=lens,
                            block_tables=tables, scale=0.125, block_m=16, block_n=16)
    ref = prefill_attention_reference(qp.float().cpu(), k32, v32, cu, seq_lens, local, 0.125)
    torch.testing.assert_close(out.float().cpu(), ref, **TOL[F16])


# ---------------------------------------------------------------- bad input


def _small(gen_seed=5):
    gen = torch.Generator().manual_seed(gen_seed)
    k_cache, v_cache = _cache(6, 8, 2, 64, F32, gen)
    tables = torch.tensor([[3, 1, 0], [5, 0, 0]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([12, 3], dtype=torch.int32, device=DEV)
    query = torch.randn(2, 4, 64, generator=gen).to(DEV)
    return {"query": query, "k_cache": k_cache, "v_cache": v_cache, "seq_lens": lens,
            "block_tables": tables, "scale": 0.125}


def _store_args():
    a = _small()
    key = torch.randn(3, 2, 64, device=DEV)
    return {"key": key, "value": key.clone(), "k_cache": a["k_cache"], "v_cache": a["v_cache"],
            "slot_mapping": torch.tensor([0, -1, 47], device=DEV)}


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(key=a["key"].int()), "floating dtype"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "int32 or int64"),
    (lambda a: a.update(value=a["value"][:2]), "value shape"),
    (lambda a: a.update(key=a["key"][:, :1], value=a["value"][:, :1]), r"key must be \[T, 2"),
    (lambda a: a.update(v_cache=a["v_cache"].half()), "dtypes must match"),
    (lambda a: a.update(slot_mapping=torch.tensor([0, 1, 48], device=DEV)), r"\[0, 48\)"),
    (lambda a: a.update(slot_mapping=torch.tensor([0, -2, 4], device=DEV)), "out of range"),
])
def test_store_kv_rejects(change, match):
    args = _store_args()
    change(args)
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=match):
        store_kv(**args)
    assert torch.equal(args["k_cache"], before)  # nothing written


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(query=a["query"].double()), "dtype"),
    (lambda a: a.update(query=a["query"][:, :3]), "multiple of the cache's kv heads"),
    (lambda a: a.update(query=a["query"][..., :32]), r"query must be \[B, Hq, 64\]"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"seq_lens must have shape \(2,\)"),
    (lambda a: a.update(seq_lens=a["seq_lens"].float()), "int32 or int64"),
    (lambda a: a["block_tables"].__setitem__((0, 1), 6), "block id 6 at block_tables"),
    (lambda a: a["block_tables"].__setitem__((1, 0), -1), "block id -1 at block_tables"),
    (lambda a: a.update(seq_lens=torch.tensor([25, 3], device=DEV)), "outside"),
    (lambda a: a.update(seq_lens=torch.tensor([12, 0], device=DEV)), "outside"),
])
def test_decode_rejects(change, match):
    args = _small()
    change(args)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**args)


def test_padding_past_a_sequence_is_not_checked():
    # Entries past ceil(seq_len / block_size) are never read; any value there is fine.
    args = _small()
    args["block_tables"][1, 1:] = 10**6
    paged_decode_attention(**args)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 2, 2], device=DEV)), "cu_seqlens"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 2], device=DEV)), "seq_lens must have"),
    (lambda a: a.update(seq_lens=torch.tensor([12, 1], device=DEV)), "outside"),
    (lambda a: a["block_tables"].__setitem__((0, 0), 99), "block id 99"),
    (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables must be"),
    (lambda a: a.update(scale=0.0), "scale must be > 0"),
])
def test_prefill_rejects(change, match):
    args = _small()
    args["query"] = torch.randn(5, 4, 64, device=DEV)
    args["cu_seqlens"] = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEV)
    change(args)
    with pytest.raises(ValueError, match=match):
        prefill_attention(**args)
