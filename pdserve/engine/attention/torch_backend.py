"""The `torch` attention backend: plain PyTorch over the paged cache.

It is the reference the Triton and C kernels are tested against, and the CPU fallback
where no C compiler exists. The three functions below are the references;
`DecodeThenPrefillBackend` is the step split it shares with the `cpu` backend, and
`TorchAttentionBackend` wires the references in.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from pdserve.engine.layers.attention import AttentionBackend, AttentionMetadata


def store_kv_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    keep: torch.Tensor | None = None,  # slot_mapping >= 0 when it has a -1, else None
    checked: bool = False,  # keep was computed for this slot_mapping
) -> None:
    if not checked:
        keep = slot_mapping >= 0
        keep = None if bool(keep.all()) else keep
    if keep is not None:
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, Hkv, D]."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    return cache[block_table[:nblocks].long()].reshape(-1, *cache.shape[2:])[:length]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    # q [B, Hq, L, D], k/v [B, Hkv, S, D]; query head h reads KV head h // (Hq // Hkv).
    # enable_gqa shares each KV head across its group without materialising copies
    # (repeat_interleave of K/V made CPU decode ~10x slower).
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def prefill_attention_reference(
    query: torch.Tensor,  # [Tq, Hq, D], the prefill tokens only
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: list[int],  # [P+1] over the prefill tokens
    seq_lens: list[int],  # [P] context length after the chunk
    block_tables: torch.Tensor,  # [P, max_blocks]
    scale: float,
) -> torch.Tensor:
    """Each chunk attends to its cached prefix and causally to itself."""
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        qlen = end - start
        prefix = seq_len - qlen
        k = gather_context(k_cache, block_tables[i], seq_len)
        v = gather_context(v_cache, block_tables[i], seq_len)
        q = query[start:end].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, Hq, L, D]
        k = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        v = v.transpose(0, 1).unsqueeze(0)
        if prefix == 0:
            o = _sdpa(q, k, v, scale, causal=qlen > 1)
        else:
            qpos = torch.arange(prefix, seq_len, device=query.device).unsqueeze(1)
            kpos = torch.arange(seq_len, device=query.device).unsqueeze(0)
            o = _sdpa(q, k, v, scale, mask=kpos <= qpos)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
    return out


@dataclass(frozen=True)
class DecodePlan:
    """What decode attention gathers for one group of sequences. It depends only on the
    batch layout, so a step builds it once and every layer reuses it."""

    rows: torch.Tensor | None  # the group's rows of the decode batch; None = all, in order
    blocks: torch.Tensor  # [B * num_blocks] block ids, each table cut/padded to num_blocks
    mask: torch.Tensor  # [B, 1, 1, num_blocks * block_size]: True where a key exists
    num_blocks: int


def plan_decode(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                max_len: int, rows: torch.Tensor | None = None) -> DecodePlan:
    nblocks = (max_len + block_size - 1) // block_size
    mask = (torch.arange(nblocks * block_size, device=seq_lens.device).unsqueeze(0)
            < seq_lens.unsqueeze(1))
    return DecodePlan(rows, block_tables[:, :nblocks].reshape(-1).long(),
                      mask[:, None, None, :], nblocks)


def decode_attention_planned(query: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, plan: DecodePlan, scale: float
                             ) -> torch.Tensor:
    b, hq, d = query.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    s = plan.num_blocks * bs
    # index_select on whole blocks is the cheapest gather; then [B, Hkv, S, D] views
    k = k_cache.index_select(0, plan.blocks).view(b, s, hkv, d).transpose(1, 2)
    v = v_cache.index_select(0, plan.blocks).view(b, s, hkv, d).transpose(1, 2)
    # a decode's G query heads of one KV head share its keys and mask: fold them into the
    # query-length axis instead of repeating K/V G times
    q = query.view(b, hkv, hq // hkv, d).to(k.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
    return o.reshape(b, hq, d).to(query.dtype)


def decode_attention_reference(
    query: torch.Tensor,  # [B, Hq, D], one token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [B] int
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One query per sequence over its whole cached context (padded batch + mask)."""
    b = query.shape[0]
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    plan = plan_decode(seq_lens[:b], block_tables[:b], k_cache.shape[1], max_len)
    return decode_attention_planned(query, k_cache, v_cache, plan, scale)


def length_buckets(seq_lens: list[int], ratio: float = 2.0) -> list[list[int]]:
    """Sequence indices grouped by similar length (ascending), so that padding every
    sequence of a group to the group's longest wastes at most `ratio`x."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and seq_lens[i] <= ratio * seq_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def plan_decode_buckets(seq_lens: torch.Tensor, seq_lens_cpu: list[int],
                        block_tables: torch.Tensor, block_size: int) -> list[DecodePlan]:
    """One plan per group of similar context lengths: the padded gather of a mixed batch
    otherwise reads up to (longest / shortest) times the bytes."""
    groups = length_buckets(seq_lens_cpu)
    if len(groups) == 1:
        return [plan_decode(seq_lens, block_tables, block_size, max(seq_lens_cpu))]
    plans = []
    for g in groups:
        rows = torch.tensor(g, device=seq_lens.device)
        plans.append(plan_decode(seq_lens[rows], block_tables[rows], block_size,
                                 max(seq_lens_cpu[i] for i in g), rows))
    return plans


def decode_attention_bucketed(query, k_cache, v_cache, plans: list[DecodePlan],
                              scale: float) -> torch.Tensor:
    if len(plans) == 1 and plans[0].rows is None:
        return decode_attention_planned(query, k_cache, v_cache, plans[0], scale)
    out = torch.empty_like(query)
    for plan in plans:
        out[plan.rows] = decode_attention_planned(query[plan.rows], k_cache, v_cache, plan,
                                                  scale)
    return out


class DecodeThenPrefillBackend(AttentionBackend):
    """A step as two parts: the decode rows through `_decode`, the prefill chunks through
    `_prefill` (`prefill_attention_reference` unless a subclass has better). What a step
    needs planned is planned at its first layer and reused by the others."""

    def __init__(self) -> None:
        self._planned_for: AttentionMetadata | None = None
        self._prefill_starts: list[int] = []
        # which rows a step stores, found at its first layer: the check is a host sync
        # and 4 dispatches, ~25 us a layer at batch 1 on the CPU
        self._slots: torch.Tensor | None = None
        self._keep: torch.Tensor | None = None

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if slot_mapping is not self._slots:
            keep = slot_mapping >= 0
            self._slots, self._keep = slot_mapping, None if bool(keep.all()) else keep
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping, self._keep,
                           checked=True)

    def _plan_decodes(self, meta: AttentionMetadata, block_size: int) -> None:
        """Per-step decode planning; nothing by default."""

    @abstractmethod
    def _decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Attention of the step's decode rows (query [num_decodes, Hq, D]), into `out`
        (contiguous) when given; returns the result."""

    def _prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """Attention of the step's prefill chunks (query: their rows) into `out`
        (contiguous)."""
        nd = meta.num_decodes
        out.copy_(prefill_attention_reference(
            query, k_cache, v_cache, self._prefill_starts, meta.seq_lens_cpu[nd:],
            meta.block_tables[nd:], scale))

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        nd = meta.num_decodes
        if self._planned_for is not meta:
            self._prefill_starts = list(accumulate(meta.query_lens_cpu[nd:], initial=0))
            self._plan_decodes(meta, k_cache.shape[1])
            self._planned_for = meta
        if nd == meta.num_seqs:
            return self._decode(query, k_cache, v_cache, meta, scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if nd:
            self._decode(query[:nd], k_cache, v_cache, meta, scale, out=out[:nd])
        self._prefill(query[nd:], k_cache, v_cache, meta, scale, out[nd:])
        return out


class TorchAttentionBackend(DecodeThenPrefillBackend):
    name = "torch"

    def __init__(self) -> None:
        super().__init__()
        self._decode_plans: list[DecodePlan] = []

    def _plan_decodes(self, meta: AttentionMetadata, block_size: int) -> None:
        nd = meta.num_decodes
        self._decode_plans = plan_decode_buckets(
            meta.seq_lens[:nd], meta.seq_lens_cpu[:nd], meta.block_tables[:nd],
            block_size) if nd else []

    def _decode(self, query, k_cache, v_cache, meta, scale, out=None):
        res = decode_attention_bucketed(query, k_cache, v_cache, self._decode_plans, scale)
        if out is None:
            return res
        return out.copy_(res)
