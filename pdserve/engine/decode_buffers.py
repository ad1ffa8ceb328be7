"""Persistent inputs of a pure-decode step, and the batch sizes a decode step is padded to.

A decode step (every sequence adds exactly one token) reads its inputs from max-sized device
buffers that each step fills in place: token ids, positions, slot mapping, context lengths,
block tables; query start offsets and logits rows are constants (one token per row). The
batch is padded up to a bucket (`decode_buckets`), so a captured CUDA graph per bucket can
replay any batch: a padded row reads token 0 at position 0 against one key of block 0 and
writes its K/V to slot -1, which both store paths (the triton kernel's mask and the torch
reference's filter) skip, so it touches no sequence's cache.

Life cycle: made once by the model runner, sized by max_num_seqs and the longest sequence;
`fill` overwrites rows [0, padded) every decode step; never freed while the runner lives.
"""

from __future__ import annotations

import torch

from pdserve.engine.layers.attention import AttentionMetadata
from pdserve.engine.scheduler import ScheduledSeq

_ID, _POS, _SLOT, _LEN = range(4)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_num_seqs (which is always the last)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8)) + [max_num_seqs]
    return sizes


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds n rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a decode batch of {n} exceeds the largest bucket {buckets[-1]}")


def is_pure_decode(scheduled: list[ScheduledSeq]) -> bool:
    """Every sequence adds one token and samples it (a one-token prefill chunk does not)."""
    return bool(scheduled) and all(s.num_new_tokens == 1 and s.samples for s in scheduled)


class DecodeBuffers:
    """Max-sized device buffers of a decode step (see the module docstring)."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.max_seqs, self.block_size, self.device = max_seqs, block_size, device
        self.max_blocks = max_blocks_per_seq
        pin = device.type == "cuda"
        # ids, positions, slots, context lengths: one host row per sequence, one copy
        self._host_cols = torch.zeros(max_seqs, 4, dtype=torch.long, pin_memory=pin)
        self._host_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32,
                                        pin_memory=pin)
        self.cols = torch.zeros(max_seqs, 4, dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_seqs,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_seqs, dtype=torch.long, device=device)

    def fill(self, scheduled: list[ScheduledSeq], padded: int) -> list[int]:
        """Write this step's rows [0, padded) in place; the context lengths (host list)."""
        n, bs = len(scheduled), self.block_size
        assert is_pure_decode(scheduled) and n <= padded <= self.max_seqs, (n, padded)
        rows, lens, seq_tables = [], [], []
        for s in scheduled:
            seq = s.seq
            p = seq.num_computed_tokens
            table = seq.block_table
            rows.append([seq.token_id(p), p, table[p // bs] * bs + p % bs, p + 1])
            lens.append(p + 1)
            if len(table) > self.max_blocks:
                raise ValueError(f"sequence {seq.request_id}: {len(table)} blocks exceed the "
                                 f"decode buffers' {self.max_blocks}")
            seq_tables.append(table)
        width = max((len(t) for t in seq_tables), default=1)
        tables = self._host_tables
        tables[:padded].zero_()  # 0 past each table, as AttentionMetadata states
        if seq_tables:
            tables[:n, :width] = torch.tensor([t + [0] * (width - len(t)) for t in seq_tables],
                                              dtype=torch.int32)
        rows += [[0, 0, -1, 1]] * (padded - n)
        lens += [1] * (padded - n)
        self._host_cols[:padded] = torch.tensor(rows, dtype=torch.long)
        self.cols[:padded].copy_(self._host_cols[:padded], non_blocking=True)
        self.block_tables[:padded].copy_(tables[:padded], non_blocking=True)
        self._split(padded)
        return lens

    def _split(self, padded: int) -> None:
        # typed views a kernel can take, filled from the one copied block of columns
        self.input_ids[:padded].copy_(self.cols[:padded, _ID])
        self.positions[:padded].copy_(self.cols[:padded, _POS])
        self.slot_mapping[:padded].copy_(self.cols[:padded, _SLOT])
        self.seq_lens[:padded].copy_(self.cols[:padded, _LEN])

    def reset_rows(self, padded: int) -> None:
        """Rows [0, padded) as padding (what a graph is captured over)."""
        self._host_cols[:padded] = torch.tensor([0, 0, -1, 1], dtype=torch.long)
        self.cols[:padded].copy_(self._host_cols[:padded])
        self.block_tables[:padded].zero_()
        self._split(padded)

    def metadata(self, padded: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
        """A fresh metadata object over the buffers' first `padded` rows. `seq_lens_cpu` is
        what the backend plans with: the real lengths eagerly, the longest possible for a
        graph that must serve every later step."""
        return AttentionMetadata(
            num_decodes=padded,
            query_start_loc=self.query_start_loc[:padded + 1],
            seq_lens=self.seq_lens[:padded],
            block_tables=self.block_tables[:padded],
            slot_mapping=self.slot_mapping[:padded],
            max_query_len=1,
            max_seq_len=max(seq_lens_cpu),
            query_lens_cpu=[1] * padded,
            seq_lens_cpu=seq_lens_cpu,
        )
