"""Offline throughput: the engine against `transformers` static batching, one run.

    python -m pdserve.bench.offline [--num-requests 64] [--dtype float32] [--out docs/offline.json]

A seeded `mixed` workload (prompts 32-512 tokens, outputs 16-256, all submitted at once)
goes through (1) the engine's continuous batching and (2) `transformers.generate` in fixed
batches of 16, left-padded, each run until its longest output is done. Output lengths are
forced (ignore_eos), so both produce the same number of useful tokens. Reported: output
tokens/s for each and their ratio, peak KV utilisation (slots holding computed tokens /
slots of the blocks held, at the step holding the most blocks), and the share of step time
spent outside the model forward, overall and over steps running >= 32 sequences.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pdserve.bench.report_io import emit_report


def _workload(tokenizer, n: int, seed: int):
    from pdserve.bench.workloads import mixed

    reqs = mixed(tokenizer, n, seed)
    return [tokenizer.encode(r.prompt) for r in reqs], [r.output_tokens for r in reqs]


def run_engine(model: str, dtype: str, prompts, outputs, threads: int | None,
               profile: bool = False, kv_cache_dtype: str | None = None) -> dict:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.protocol import SamplingParams

    eng = LLMEngine(EngineConfig(model=model, dtype=dtype, kv_cache_memory="2GiB",
                                 kv_cache_dtype=kv_cache_dtype, num_threads=threads,
                                 show_progress=False))
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outputs]
    eng.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    eng.trace = []
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    tokens = sum(len(o.token_ids) for o in outs)
    trace = eng.trace
    peak = max(trace, key=lambda t: t.allocated_slots)
    busy = [t for t in trace if len(t.scheduled) >= 32]

    def overhead(steps) -> float | None:
        total = sum(t.total_seconds for t in steps)
        return None if not total else 1 - sum(t.forward_seconds for t in steps) / total

    return {
        "wall_s": round(wall, 2), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1),
        "prompt_tokens": sum(len(p) for p in prompts), "steps": len(trace),
        "peak_kv_utilisation": round(peak.used_slots / peak.allocated_slots, 4),
        "peak_kv_slots": peak.allocated_slots,
        "overhead_share_all_steps": round(overhead(trace), 4),
        "overhead_share_steps_ge32_running": (round(overhead(busy), 4) if busy else None),
        "steps_ge32_running": len(busy),
    }


def run_transformers(model: str, dtype: str, prompts, outputs, batch: int = 16) -> dict:
    from transformers import AutoModelForCausalLM

    from pdserve.engine.model_files import resolve_model

    src = resolve_model(model)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    hf = AutoModelForCausalLM.from_pretrained(src.directory, dtype=getattr(torch, dtype), **kw)
    hf.eval()
    useful = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, outs = prompts[i:i + batch], outputs[i:i + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        n = max(outs)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        useful += sum(outs)
        print(f"  transformers batch {i // batch + 1}: {time.perf_counter() - t0:.0f}s",
              file=sys.stderr)
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 2), "output_tokens": useful,
            "output_tokens_per_s": round(useful / wall, 1), "batch_size": batch}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.offline", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default=None, choices=["float32", "bfloat16"],
                   help="KV cache dtype (default: --dtype)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--skip-transformers", action="store_true",
                   help="measure the engine only (no baseline, no ratio)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the engine run and print its top functions to stderr")
    p.add_argument("--out", default=None, help="write the JSON report here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from pdserve.engine.model_files import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(a.model))
    prompts, outputs = _workload(tok, a.num_requests, a.seed)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(outputs)} output tokens", file=sys.stderr)
    report = {"command": "python -m pdserve.bench.offline " + " ".join(argv or sys.argv[1:]),
              "model": a.model, "dtype": a.dtype, "threads": torch.get_num_threads()}
    report["kv_cache_dtype"] = a.kv_cache_dtype or a.dtype
    report["engine"] = run_engine(a.model, a.dtype, prompts, outputs, a.threads, a.profile,
                                  a.kv_cache_dtype)
    print(f"engine: {report['engine']}", file=sys.stderr)
    if not a.skip_transformers:
        report["transformers_static"] = run_transformers(a.model, a.dtype, prompts, outputs)
        report["speedup"] = round(report["engine"]["output_tokens_per_s"]
                                  / report["transformers_static"]["output_tokens_per_s"], 2)
    emit_report(report, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
