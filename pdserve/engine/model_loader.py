"""Loading a model's weights: a Hugging Face directory's safetensors are read directly,
anything else (a GGUF, a .bin checkpoint) through `transformers`, whose modules are not
kept — the weights move into `pdserve.engine.llama.LlamaModel`. A GGUF's de-quantized
weights are cached after its first load (`weight_cache`). Finding a model and
reading its config and tokenizer are torch-free, in `model_files`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from pdserve.engine.model_files import ModelSource

__all__ = ["load_hf_weights"]


def load_hf_weights(source: ModelSource, show_progress: bool = True) -> tuple[Any, dict]:
    """(config, state_dict) in float32, read through transformers (a GGUF: from the
    weight cache after its first load)."""
    from pdserve.engine import weight_cache

    t0 = time.perf_counter()
    where = source.directory + (f"/{source.gguf_file}" if source.gguf_file else "")
    print(f"loading model {source.name} from {where} ...", file=sys.stderr, flush=True)
    # the entry's key hashes the whole GGUF: computed once, for the read and the write
    entry = (weight_cache.cache_key_dir(os.path.join(source.directory, source.gguf_file))
             if source.gguf_file else None)
    if entry is not None:
        cached = weight_cache.load_cached(entry)
        if cached is not None:
            print(f"model {source.name} loaded from the weight cache in "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
            return cached
    else:
        direct = _read_safetensors_dir(source.directory)
        if direct is not None:
            print(f"model {source.name} loaded in {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr, flush=True)
            return direct
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not show_progress:
        hf_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    hf_model = AutoModelForCausalLM.from_pretrained(source.directory, **kwargs)
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    print(f"model {source.name} loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr,
          flush=True)
    if entry is not None and weight_cache.store(entry, hf_model.config, state):
        print(f"its de-quantized weights are cached for the next load: {entry}",
              file=sys.stderr, flush=True)
    return hf_model.config, state


def _read_safetensors_dir(directory: str) -> tuple[Any, dict] | None:
    """(config, float32 state dict) read straight from a Hugging Face directory's
    safetensors files (aligned copies, `weight_cache.read_float32`), or None where it has
    none (a .bin checkpoint: transformers reads it). Skips building transformers' model,
    whose modeling code alone took ~2 s to import at every worker start."""
    from pathlib import Path

    from pdserve.engine.weight_cache import read_float32

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    from pdserve.engine.llama_config import model_config

    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            state.update(read_float32(f))
    return model_config(directory), state
