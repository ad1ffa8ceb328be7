"""LLMEngine: one worker's engine — scheduler + model runner + block pool, stepped by the
caller (offline `generate`, or the AsyncEngine thread that the services use).

A request's life: `add_request` validates and queues it; each `step` schedules a batch,
runs it, appends sampled tokens, finishes sequences that hit a stop condition and returns
their blocks. KV leaves and enters through `kv_connector` (`pdserve.engine.kv_connector`):
a request added with a `KVSaver` has its prompt's KV saved layer by layer as it is
computed; `reserve` / `commit_remote_kv` are the connector's bookkeeping for a prompt whose
KV another worker pushes. With overlap scheduling on (`EngineConfig.overlap_scheduling`),
`step` delegates to `pdserve.engine.overlap`: it schedules and prepares the next step while
the launched one runs, and returns the deltas of the step before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig
from pdserve.engine.heap_tuning import retain_freed_memory
from pdserve.engine.kv_cache import PagedKVCache, dtype_from_name
from pdserve.engine.kv_connector import KVConnector, KVSaver, PagedKVConnector
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.engine.layers.registry import get_backend
from pdserve.engine.llama import LlamaDims, LlamaModel
from pdserve.engine.model_files import ModelSource, eos_token_ids, load_tokenizer, resolve_model
from pdserve.engine.model_loader import load_hf_weights
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.overlap import OverlapStepper
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.protocol import SamplingParams, TokenLogprobs

log = logging.getLogger("pdserve.engine")


@dataclass(frozen=True)
class SeqDelta:
    """What one step produced for one sequence."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    arrival_time: float  # monotonic, when the engine accepted it
    first_scheduled_time: float | None  # monotonic, when it first ran (or KV committed)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    text: str | None = None


@dataclass(frozen=True)
class StepTrace:
    """One step as the scheduler saw it: (request id, tokens computed) per sequence."""

    step: int
    scheduled: tuple[tuple[str, int], ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    forward_seconds: float  # the model forward alone
    total_seconds: float  # schedule + prepare + forward + sample + bookkeeping
    used_slots: int  # cache slots holding computed tokens of running sequences
    allocated_slots: int  # slots of the blocks those sequences hold


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.set_num_threads(config.threads())
        if torch.device(config.device).type == "cpu":
            retain_freed_memory()  # pdserve.engine.heap_tuning: no page faults per layer
        self.source: ModelSource = resolve_model(config.model)
        hf_config, state = load_hf_weights(self.source, config.show_progress)
        self.hf_config = hf_config
        self.tokenizer = load_tokenizer(self.source)
        self.eos_token_ids = eos_token_ids(hf_config, self.tokenizer, self.source)
        self.dims = LlamaDims.from_hf_config(hf_config)
        device = torch.device(config.device)
        self.model = LlamaModel(self.dims, state, hf_config, dtype_from_name(config.dtype),
                                device, quantization=config.quantization)
        del state
        if config.gguf_blocks and self.source.gguf_file and device.type == "cpu":
            self._keep_gguf_blocks()
        d = self.dims
        num_blocks = config.num_kv_blocks or KVCacheSpec.blocks_for_budget(
            config.kv_cache_bytes, d.num_layers, config.block_size, d.num_kv_heads, d.head_dim,
            config.cache_dtype)
        self.kv_spec = KVCacheSpec(d.num_layers, num_blocks, config.block_size, d.num_kv_heads,
                                   d.head_dim, config.cache_dtype)
        self.kv_cache = PagedKVCache(self.kv_spec, device)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_batched_tokens, config.max_num_seqs)
        self.max_model_len = min(config.max_model_len or d.max_position, d.max_position)
        self.runner = ModelRunner(self.model, self.kv_cache, get_backend(
            config.attention_backend, device), self.eos_token_ids, config.max_num_seqs,
            self.max_model_len, config.enforce_eager)
        self.seqs: dict[str, Sequence] = {}
        self.kv_connector: KVConnector = PagedKVConnector(self)
        self.counters = EngineCounters()
        self.trace: list[StepTrace] | None = None  # set to [] to record every step
        self.on_finish: Callable[[Sequence], None] | None = None
        # step N+1 scheduled and prepared while N runs (pdserve.engine.overlap); None: in turn
        self.overlap = OverlapStepper(self) if config.overlap_enabled else None
        log.info("engine ready: %s, %d KV blocks of %d tokens (%.1f MiB), attention backend "
                 "%s, layer ops %s, overlap scheduling %s", self.source.name, num_blocks,
                 config.block_size, num_blocks * self.kv_spec.bytes_per_block_all_layers / 2**20,
                 self.runner.backend.name, self.runner.model.ops.name,
                 "on" if self.overlap else "off")

    # -- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; send token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must contain at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens does not fit the model's context of "
                             f"{self.max_model_len} tokens")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens")
        vocab = self.dims.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        need = self.pool.blocks_needed(n + params.max_tokens)
        if need > self.pool.num_blocks:
            raise ValueError(f"max_tokens: the request needs {need} KV blocks, this worker's "
                             f"cache holds {self.pool.num_blocks}")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prefill_only: bool = False, kv_saver: KVSaver | None = None) -> Sequence:
        """Validate and queue a request; with `kv_saver`, its prompt's KV is handed to the
        saver layer by layer in the step that completes the prompt."""
        if request_id in self.seqs:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ids = self.encode_prompt(prompt)
        self.validate(ids, params)
        seq = Sequence(request_id, ids, params, arrival_time=time.monotonic(),
                       prefill_only=prefill_only)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.counters.prompt_tokens += len(ids)
        if kv_saver is not None:
            self.kv_connector.add_saver(request_id, kv_saver)
        return seq

    def abort_request(self, request_id: str) -> SeqDelta | None:
        """Finish a request as aborted and free its blocks; the final (empty) delta, or
        None when the request is unknown or already finished."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if self.overlap is not None:
            self.overlap.forget(seq)
        if not seq.is_finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._count_finish(seq)
        return self._delta(seq, [], [])

    # -- disaggregation: the KV connector's bookkeeping (call `kv_connector`, not these) ---
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                ) -> Sequence:
        """Hold blocks for a prompt whose KV another worker pushes. RuntimeError if full."""
        if request_id in self.seqs:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if not self.scheduler.can_reserve(len(prompt_token_ids)):
            raise RuntimeError(
                f"no room: {self.pool.blocks_needed(len(prompt_token_ids))} KV blocks needed, "
                f"{self.pool.num_free_blocks} free")
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_time=time.monotonic())
        self.scheduler.reserve(seq)
        self.seqs[request_id] = seq
        return seq

    def commit_remote_kv(self, request_id: str, first_token: int,
                         logprobs: TokenLogprobs | None = None) -> SeqDelta:
        """The prompt's KV is in the reserved blocks; append the first token and run."""
        seq = self.seqs[request_id]
        self.scheduler.commit_remote_kv(seq)
        self.counters.prompt_tokens += seq.num_prompt_tokens
        return self._append_token(seq, first_token, logprobs)

    # -- stepping ---------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.overlap is not None
                                             and self.overlap.has_inflight())

    def _keep_gguf_blocks(self) -> None:
        """The weights' GGUF blocks for the decode stack, where the model has them
        (pdserve.engine.gguf_blocks)."""
        from pdserve.engine.gguf_blocks import gemv_rows, model_blocks

        t0 = time.perf_counter()
        path = os.path.join(self.source.directory, self.source.gguf_file)
        blocks = model_blocks(path, self.model)
        self.model.gguf_blocks = blocks
        if blocks is not None:
            log.info("decode steps of 1-%d sequences stream the weights' GGUF blocks (%.0f MB; "
                     "the LM head's %s), the same values as the %s rows (matched in %.1fs)",
                     gemv_rows(self.model.dtype), blocks.nbytes / 1e6,
                     "too" if blocks.head is not None else "rows", self.config.dtype,
                     time.perf_counter() - t0)

    def step(self) -> list[SeqDelta]:
        if self.overlap is not None:
            return self.overlap.step()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        conn = self.kv_connector
        try:
            results = self.runner.run(sched.scheduled, conn.save_layer if conn.saving else None)
        finally:
            conn.step_done()  # copies of this step's KV are done before any block is freed
        forward_s = self.runner.last_timing.forward_s
        self.scheduler.after_step(sched.scheduled)
        if self.trace is not None:  # before finished sequences give their blocks back
            used = sum(s.seq.num_computed_tokens for s in sched.scheduled)
            allocated = sum(len(s.seq.block_table) for s in sched.scheduled) * self.pool.block_size
        else:
            used = allocated = 0
        deltas = [self._append_token(s.seq, tok, lp) for s, tok, lp in results]
        self._record_step(sched, deltas, forward_s, time.perf_counter() - t0, used, allocated)
        return deltas

    def _record_step(self, sched: SchedulerOutput, deltas: list[SeqDelta], forward_s: float,
                     total: float, used: int, allocated: int) -> None:
        c = self.counters
        c.steps += 1
        c.forward_seconds += forward_s
        c.step_seconds += total
        if self.trace is not None:
            self.trace.append(StepTrace(
                c.steps, tuple((s.seq.request_id, s.num_new_tokens) for s in sched.scheduled),
                tuple(s.request_id for s in sched.preempted),
                tuple(d.request_id for d in deltas if d.finished), forward_s, total, used,
                allocated))

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> SeqDelta:
        seq.output_token_ids.append(token)
        if lp is not None:
            seq.output_logprobs.append(lp)
        self.counters.generation_tokens += 1
        status = self._stop_status(seq, token)
        if status is not None:
            self.scheduler.finish(seq, status)
            self.seqs.pop(seq.request_id, None)
            self._count_finish(seq)
        return self._delta(seq, [token], [lp] if lp is not None else [])

    def _delta(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprobs]) -> SeqDelta:
        return SeqDelta(seq.request_id, tokens, lps, seq.is_finished, seq.finish_reason,
                        seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens,
                        seq.arrival_time, seq.first_scheduled_time)

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        p = seq.params
        if seq.prefill_only:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _count_finish(self, seq: Sequence) -> None:
        reason = seq.finish_reason or "abort"
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        self.kv_connector.request_finished(seq)
        if self.on_finish is not None:
            self.on_finish(seq)

    # -- offline API ------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run every prompt to completion, continuously batched; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(f"offline-{id(prompts)}-{i}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, plist))]
        while self.has_unfinished():
            self.step()
        return [self._output(s) for s in seqs]

    def _output(self, seq: Sequence) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             list(seq.output_logprobs), seq.finish_reason, text)
