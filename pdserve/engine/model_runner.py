"""The model runner: turns a SchedulerOutput into tensors, runs the forward, samples.

It owns the model weights, the paged KV cache and the attention backend; it knows nothing
about queues or requests beyond the batch it is handed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.llama import LlamaModel
from pdserve.engine.sampler import SampleRow, sample
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import TokenLogprobs

# Called after every layer with (layer index, the sequences whose prompt completes this step).
KVLayerHook = Callable[[int, list[ScheduledSeq]], None]


@dataclass(frozen=True)
class RunTiming:
    prepare_s: float
    forward_s: float  # the model forward alone (what the rest is overhead against)
    sample_s: float


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling: list[ScheduledSeq]  # rows of logits_indices, in order


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, backend: AttentionBackend,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.block_size = kv_cache.spec.block_size
        self.device = model.device
        self.last_timing = RunTiming(0.0, 0.0, 0.0)

    def prepare(self, scheduled: list[ScheduledSeq]) -> BatchInputs:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        sampling: list[ScheduledSeq] = []
        max_blocks = 1
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            tokens = seq.all_token_ids
            ids.extend(tokens[start:start + n])
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            max_blocks = max(max_blocks, len(table))
            if s.samples:
                logits_idx.append(qsl[-1] - 1)
                sampling.append(s)
        tables = torch.tensor([s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table))
                               for s in scheduled], dtype=torch.int32)
        dev = self.device
        query_lens = [s.num_new_tokens for s in scheduled]
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            sampling=sampling,
        )

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], layer_hook: KVLayerHook | None = None
            ) -> list[tuple[ScheduledSeq, int, TokenLogprobs | None]]:
        """Forward the batch; sample a token for every sequence that reached its end."""
        t0 = time.perf_counter()
        batch = self.prepare(scheduled)
        t1 = time.perf_counter()
        hook = None
        if layer_hook is not None and batch.sampling:
            sampling = batch.sampling

            def hook(layer: int) -> None:
                layer_hook(layer, sampling)

        logits = self.model.forward(batch.input_ids, batch.positions, self.kv_cache, batch.meta,
                                    self.backend, batch.logits_indices, hook)
        t2 = time.perf_counter()
        out = []
        if batch.sampling:
            rows = [SampleRow(s.seq.params, s.seq.prompt_token_ids, s.seq.output_token_ids,
                              self.eos_token_ids) for s in batch.sampling]
            results = sample(logits.cpu(), rows)
            out = [(s, tok, lp) for s, (tok, lp) in zip(batch.sampling, results)]
        self.last_timing = RunTiming(t1 - t0, t2 - t1, time.perf_counter() - t2)
        return out
