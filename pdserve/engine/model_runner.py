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

A step runs in three phases, `prepare_step` (host: inputs and sampling parameters into the
buffers) -> `launch` (forward + sampler, and the copy of the sampled ids to the host
started) -> `wait` (the ids read on the host); `run` is the three in a row. The engine's
overlap mode (`overlap`) prepares step N+1 between N's launch and wait; then some of N+1's
input tokens are N's outputs, gathered on the device (`PendingInputs`). On CUDA a launch
only queues work; on the CPU it has finished when it returns, so the same code runs
synchronously there.
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


@dataclass(frozen=True)
class PendingInputs:
    """Input tokens of a step that an earlier step samples and the host does not know yet:
    (flat input row, row of `source`) pairs; `source` is that step's sampler output on the
    device ([rows, 2 + 2K], token id in column 0)."""

    source: torch.Tensor
    rows: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StepPlan:
    """A step prepared on the host; its inputs are in (or queued to) the device buffers."""

    scheduled: list[ScheduledSeq]
    sampling: list[ScheduledSeq]  # the sequences that sample, in row order
    rows: list[SampleRow]
    flags: SampleFlags
    bufs: SamplingBuffers
    batch: BatchInputs | None  # the per-step path; None: the static decode path
    padded: int  # the static path's bucket
    lens: list[int]  # the static path's context lengths
    layer_hook: KVLayerHook | None
    prepare_s: float


@dataclass(frozen=True)
class StepHandle:
    """A launched step: its sampler output on the device and the host tensor it is being
    copied into (None when no sequence samples)."""

    plan: StepPlan
    packed: torch.Tensor | None
    host: torch.Tensor | None
    launch_s: float


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
        # recorded after a step's host -> device input copies (CUDA)
        self._inputs_copied = torch.cuda.Event() if on_cuda else None
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

    # -- a step in three phases: prepare (host), launch (device), wait ----------------------
    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], layer_hook: KVLayerHook | None = None
            ) -> list[tuple[ScheduledSeq, int, TokenLogprobs | None]]:
        """Forward the batch; sample a token for every sequence that reached its end."""
        return self.wait(self.launch(self.prepare_step(scheduled, layer_hook)))

    @torch.inference_mode()
    def prepare_step(self, scheduled: list[ScheduledSeq], layer_hook: KVLayerHook | None = None,
                     pending: PendingInputs | None = None) -> StepPlan:
        """Build the step's inputs and sampling parameters. On CUDA this may run while an
        earlier launched step still computes: device buffers are written by copies queued
        behind it, and the input tokens named in `pending` are gathered from that step's
        sampler output on the device."""
        t0 = time.perf_counter()
        if self._inputs_copied is not None:
            # the pinned staging rows are rewritten below: the last step's copies must be done
            self._inputs_copied.synchronize()
        sampling = [s for s in scheduled if s.samples]
        rows = self._rows(sampling)
        static = (self.decode_bufs is not None and layer_hook is None
                  and is_pure_decode(scheduled) and len(scheduled) <= self.buckets[-1])
        batch, padded, lens = None, 0, []
        if static:
            assert self.decode_bufs is not None
            padded = bucket_for(len(scheduled), self.buckets)
            lens = self.decode_bufs.fill(scheduled, padded)
            input_ids = self.decode_bufs.input_ids
        else:
            batch = self.prepare(scheduled)
            input_ids = batch.input_ids
        if pending is not None and pending.rows:
            _gather_pending(input_ids, pending, self.device)
        bufs = self.sampling
        if len(rows) > bufs.max_rows:  # more than max_num_seqs: one-off buffers
            bufs = SamplingBuffers(len(rows), self.sampling.vocab, self.device)
        flags = bufs.fill(rows, padded or len(rows)) if rows else SampleFlags()
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        return StepPlan(scheduled, sampling, rows, flags, bufs, batch, padded, lens, layer_hook,
                        time.perf_counter() - t0)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepHandle:
        """Run the forward and the sampler and start the copy of the sampled ids to the host.
        On CUDA this only queues work; on the CPU it has finished when it returns."""
        t0 = time.perf_counter()
        packed = host = None
        if plan.batch is None:  # the static decode path
            if self.graphs is not None and plan.padded in self.graphs:
                packed = self.graphs.replay(plan.padded)
            else:
                packed = self._decode_step(plan.padded, plan.lens, plan.flags)
        else:
            batch, hook = plan.batch, None
            if plan.layer_hook is not None and plan.sampling:
                layer_hook, sampling = plan.layer_hook, plan.sampling

                def hook(layer: int) -> None:
                    layer_hook(layer, sampling)

            logits = self.model.forward(batch.input_ids, batch.positions, self.kv_cache,
                                        batch.meta, self.backend, batch.logits_indices, hook)
            if plan.sampling:
                packed = sample_on_device(logits, plan.bufs, plan.flags)
        if packed is not None:
            host = plan.bufs.copy_out(packed, len(plan.rows))
        return StepHandle(plan, packed, host, time.perf_counter() - t0)

    def wait(self, handle: StepHandle) -> list[tuple[ScheduledSeq, int, TokenLogprobs | None]]:
        """The launched step's sampled tokens, one per sampling sequence, in order."""
        t0 = time.perf_counter()
        plan = handle.plan
        out = []
        if handle.host is not None:
            results = plan.bufs.decode(handle.host, plan.rows)
            out = [(s, tok, lp) for s, (tok, lp) in zip(plan.sampling, results)]
        # forward_s: the forward and the sampler (on CUDA the launches, or the graph replay)
        self.last_timing = RunTiming(plan.prepare_s, handle.launch_s, time.perf_counter() - t0)
        return out

    def _rows(self, scheduled: list[ScheduledSeq]) -> list[SampleRow]:
        return [SampleRow(s.seq.params, s.seq.prompt_token_ids, s.seq.output_token_ids,
                          self.eos_token_ids) for s in scheduled]

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


def _gather_pending(input_ids: torch.Tensor, pending: PendingInputs, device: torch.device
                    ) -> None:
    """input_ids[dst] = the token the earlier step sampled in row src, on the device: the
    copy is queued behind that step, so the host never waits for it."""
    dst, src = zip(*pending.rows)
    dst_t = torch.tensor(dst, dtype=torch.long).to(device, non_blocking=True)
    src_t = torch.tensor(src, dtype=torch.long).to(device, non_blocking=True)
    tokens = pending.source.index_select(0, src_t)[:, 0].to(torch.long)
    input_ids.index_copy_(0, dst_t, tokens)
