"""The model runner: turns a SchedulerOutput into tensors, runs the forward, samples.

It owns the model weights, the paged KV cache, the attention backend and the step's
persistent buffers; it knows nothing about queues or requests beyond the batch it is handed.

Two ways through a step, one sampler (`device_sampler`, on the logits' device, one copy of
the result to the host):
- a pure-decode step (every sequence adds one sampled token, no layer hook) is padded to a
  bucket and read from persistent buffers (`decode_buffers`); on CUDA it replays the
  bucket's captured graph (`cuda_graphs`, captured at construction unless enforce_eager),
  elsewhere the same step function runs eagerly;
- prefill and mixed steps build their tensors per step (`prepare`) and run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.decode_buffers import DecodeBuffers, bucket_for, decode_buckets, is_pure_decode
from pdserve.engine.device_sampler import SampleFlags, SamplingBuffers, sample_on_device
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.llama import LlamaModel
from pdserve.engine.sampler import SampleRow
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.protocol import TokenLogprobs

log = logging.getLogger(__name__)

# Whether a CPU engine sends decode steps through the static buffers. Off: without graphs
# there is no launch cost to save, and padding to a bucket costs whole rows of compute.
# Measured once (SmolLM2-135M, the offline bench's 16 mixed requests, 2 threads on a heavily
# shared machine, one engine, runs interleaved): mean decode step 1.12 s and 2.06 s on the
# per-step path, 1.96 s static: no gain beyond the noise; identical tokens. The static path
# stays tested on the CPU (tests/test_static_decode.py).
STATIC_DECODE_ON_CPU = False

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
                 eos_token_ids: tuple[int, ...], max_num_seqs: int = 256,
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 static_decode: bool | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.block_size = kv_cache.spec.block_size
        self.device = model.device
        self.last_timing = RunTiming(0.0, 0.0, 0.0)
        self.max_model_len = max_model_len or model.dims.max_position
        self.sampling = SamplingBuffers(max_num_seqs, model.dims.vocab_size, self.device)
        on_cuda = self.device.type == "cuda"
        self.static_decode = (on_cuda or STATIC_DECODE_ON_CPU) if static_decode is None \
            else static_decode
        self.buckets = decode_buckets(max_num_seqs)
        self.decode_bufs = DecodeBuffers(
            max_num_seqs, -(-self.max_model_len // self.block_size), self.block_size,
            self.device) if self.static_decode else None
        self.graphs: DecodeGraphs | None = None
        if self.static_decode and on_cuda and not enforce_eager:
            if backend.name != "triton":  # the torch store filters slots: not capturable
                log.warning("decode CUDA graphs need the triton attention backend, not %s: "
                            "running eagerly", backend.name)
            else:
                self._capture()

    def _capture(self) -> None:
        assert self.decode_bufs is not None
        self.decode_bufs.reset_rows(self.buckets[-1])
        self.sampling.ensure_dense()
        self.sampling.fill([], self.buckets[-1])
        longest = self.max_model_len
        self.graphs = DecodeGraphs()
        self.graphs.capture(lambda b: self._decode_step(b, [longest] * b, SampleFlags.ALL),
                            self.buckets, self.device)

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
        if (self.decode_bufs is not None and layer_hook is None and is_pure_decode(scheduled)
                and len(scheduled) <= self.buckets[-1]):
            return self._run_decode(scheduled, t0)
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
            rows = self._rows(batch.sampling)
            bufs = self.sampling
            if len(rows) > bufs.max_rows:  # more than max_num_seqs: one-off buffers
                bufs = SamplingBuffers(len(rows), logits.shape[-1], self.device)
            flags = bufs.fill(rows, len(rows))
            results = bufs.fetch(sample_on_device(logits, bufs, flags), rows)
            out = [(s, tok, lp) for s, (tok, lp) in zip(batch.sampling, results)]
        self.last_timing = RunTiming(t1 - t0, t2 - t1, time.perf_counter() - t2)
        return out

    def _rows(self, scheduled: list[ScheduledSeq]) -> list[SampleRow]:
        return [SampleRow(s.seq.params, s.seq.prompt_token_ids, s.seq.output_token_ids,
                          self.eos_token_ids) for s in scheduled]

    def _run_decode(self, scheduled: list[ScheduledSeq], t0: float
                    ) -> list[tuple[ScheduledSeq, int, TokenLogprobs | None]]:
        """A pure-decode step through the persistent buffers, padded to its bucket."""
        assert self.decode_bufs is not None
        padded = bucket_for(len(scheduled), self.buckets)
        lens = self.decode_bufs.fill(scheduled, padded)
        rows = self._rows(scheduled)
        flags = self.sampling.fill(rows, padded)
        t1 = time.perf_counter()
        if self.graphs is not None and padded in self.graphs:
            packed = self.graphs.replay(padded)
        else:
            packed = self._decode_step(padded, lens, flags)
        t2 = time.perf_counter()
        results = self.sampling.fetch(packed, rows)
        # forward_s: the forward and the sampler (one graph on CUDA; launches only there)
        self.last_timing = RunTiming(t1 - t0, t2 - t1, time.perf_counter() - t2)
        return [(s, tok, lp) for s, (tok, lp) in zip(scheduled, results)]

    def _decode_step(self, padded: int, seq_lens_cpu: list[int], flags: SampleFlags
                     ) -> torch.Tensor:
        """Embedding -> layers -> logits -> sampler over the buffers' first `padded` rows:
        what a graph captures, and what runs eagerly without one."""
        bufs = self.decode_bufs
        assert bufs is not None
        meta = bufs.metadata(padded, seq_lens_cpu)
        logits = self.model.forward(bufs.input_ids[:padded], bufs.positions[:padded],
                                    self.kv_cache, meta, self.backend,
                                    bufs.logits_indices[:padded])
        return sample_on_device(logits, self.sampling, flags)
