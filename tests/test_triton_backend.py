"""TritonAttentionBackend against TorchAttentionBackend on one mixed step (CPU, interpreter).

The batch is what the model runner builds: decodes first, then prefill chunks, some with a
cached prefix; both backends store the step's K/V into copies of one cache and attend.
"""

import dataclasses

import pytest
import torch

from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.attention.triton_backend import TritonAttentionBackend
from pdserve.engine.kernels.common import interpreted
from pdserve.engine.layers.attention import AttentionMetadata
from pdserve.engine.layers.registry import get_backend

# Compiled on a GPU by scripts/gpu_check.py; the torch backend stays on the CPU there
# (its prefill reference builds masks on the CPU).
DEV = "cpu" if interpreted() else "cuda"
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                reason="kernels were compiled for a GPU and there is none")

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM, NUM_BLOCKS = 16, 2, 6, 64, 40


def _step(seqs: list[tuple[int, int]], num_decodes: int, gen: torch.Generator):
    """AttentionMetadata for (query_len, seq_len) per sequence, on shuffled blocks."""
    need = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for _, s in seqs]
    ids = torch.randperm(NUM_BLOCKS, generator=gen)[:sum(need)].int()
    tables = torch.zeros(len(seqs), max(need) + 1, dtype=torch.int32)
    slots, starts, at = [], [0], 0
    for row, ((q, s), n) in enumerate(zip(seqs, need)):
        tables[row, :n] = ids[at:at + n]
        at += n
        pos = torch.arange(s - q, s)
        slots.append(tables[row, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        num_decodes=num_decodes,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.cat(slots),
        max_query_len=max(q for q, _ in seqs),
        max_seq_len=max(s for _, s in seqs),
        query_lens_cpu=[q for q, _ in seqs],
        seq_lens_cpu=[s for _, s in seqs],
    )


def _to(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    return dataclasses.replace(
        meta, query_start_loc=meta.query_start_loc.to(device), seq_lens=meta.seq_lens.to(device),
        block_tables=meta.block_tables.to(device), slot_mapping=meta.slot_mapping.to(device))


@pytest.mark.parametrize("seqs,num_decodes,dtype,atol", [
    # decodes around block edges, then a fresh prompt and chunks with cached prefixes
    ([(1, 1), (1, 16), (1, 17), (1, 90), (20, 20), (7, 40), (16, 33)], 4, torch.float32, 2e-5),
    ([(1, 5), (1, 70)], 2, torch.float32, 2e-5),  # decode-only step
    ([(9, 9), (30, 64)], 0, torch.float32, 2e-5),  # prefill-only step
    ([(1, 33), (12, 50)], 1, torch.bfloat16, 3e-2),  # bf16: the kernel's own rounding
    # a float32 model over a bfloat16 cache (kv_cache_dtype): the query goes in as bf16
    ([(1, 33), (12, 50)], 1, (torch.float32, torch.bfloat16), 3e-2),
])
def test_triton_matches_torch_backend(seqs, num_decodes, dtype, atol):
    dtype, cache_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    gen = torch.Generator().manual_seed(0)
    meta = _step(seqs, num_decodes, gen)
    num_tokens = len(meta.slot_mapping)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)  # the cached prefixes
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    key = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    query = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM ** -0.5

    outs, caches = [], []
    for backend, dev in ((TorchAttentionBackend(), "cpu"), (TritonAttentionBackend(), DEV)):
        m = _to(meta, dev)
        kc, vc = k_cache.clone().to(dev), v_cache.clone().to(dev)
        backend.store_kv(key.to(dev), value.to(dev), kc, vc, m.slot_mapping)
        outs.append(backend.forward(query.to(dev), kc, vc, m, scale).cpu())
        caches.append((kc.cpu(), vc.cpu()))
    if cache_dtype == dtype:
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1],
                                                                       caches[1][1])
    else:  # a narrowing cast: the interpreter truncates where torch rounds, one bf16 ulp
        for a, b in zip(caches[0], caches[1]):
            torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=2 ** -7)
    assert outs[1].shape == (num_tokens, HEADS, HEAD_DIM) and outs[1].dtype == dtype
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=atol)


def test_registered_and_selectable():
    assert isinstance(get_backend("triton"), TritonAttentionBackend)


def test_bad_block_id_is_refused_once_per_step():
    gen = torch.Generator().manual_seed(1)
    meta = _step([(1, 20), (5, 5)], 1, gen)
    meta.block_tables[0, 1] = NUM_BLOCKS  # the decode's second block
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEV)
    query = torch.randn(6, HEADS, HEAD_DIM, device=DEV)
    with pytest.raises(ValueError, match=f"block id {NUM_BLOCKS}"):
        TritonAttentionBackend().forward(query, k_cache, k_cache.clone(), _to(meta, DEV), 0.125)
