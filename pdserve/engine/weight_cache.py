"""The de-quantized weights of a GGUF, cached as float32 safetensors beside the other
per-model caches, so that only the first load of a GGUF pays for transformers'
de-quantization (SmolLM2-135M's Q4_1: 19-28 s on 2 cores; every worker start, every
restart after a crash, every test that starts a real worker paid it again).

    first load  -> transformers reads the GGUF; its state dict and config are written into
                   <cache>/weights/<key>/ (model.safetensors, config.json) through
                   `model_files.publish_dir` (a directory that exists is complete)
    every load  -> both read back and the tensors copied into aligned memory: 2.8-3.6 s in
                   all for SmolLM2-135M, most of it importing transformers for the config

<cache> is `cpu_kernels.build.cache_dir`. <key> hashes the whole GGUF (its weights are what
is cached: two files with one header may differ in every weight), the format below and the
transformers version (its de-quantization is what the file holds). Tensors that share
storage in the state dict (tied embeddings: `lm_head.weight` is `embed_tokens.weight`) are
stored once and aliased again on load. A cache that cannot be written is logged and skipped;
an entry that cannot be read is logged and removed.

`python -m pdserve.engine.weight_cache MODEL` fills the cache ahead of time (`make venv`
does it for the default model).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.model_files import ModelSource, publish_dir, resolve_model

log = logging.getLogger("pdserve.engine")

WEIGHTS_FORMAT = 1  # bumped when what the cache holds changes
WEIGHTS_FILE = "model.safetensors"
_ALIASES = "pdserve_aliases"  # safetensors metadata: {alias: the key it shares storage with}


def cache_key_dir(gguf_path: str | os.PathLike) -> Path:
    """Where the weights of this GGUF are cached (the directory may not exist yet)."""
    from pdserve.engine.cpu_kernels.build import cache_dir

    h = hashlib.sha256(f"pdserve-weights {WEIGHTS_FORMAT} transformers "
                       f"{importlib.metadata.version('transformers')}\0".encode())
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return cache_dir() / "weights" / h.hexdigest()[:32]


def load_cached(entry: Path) -> tuple[Any, dict[str, torch.Tensor]] | None:
    """(config, state dict) from the cache entry `entry` (`cache_key_dir`), or None when it
    does not exist yet. An entry that cannot be read (damaged outside pdserve) is logged and
    removed, so the next load reads the GGUF and writes it again."""
    if not entry.is_dir():
        return None
    try:
        return _read_entry(entry)
    except Exception as e:  # noqa: BLE001 - whatever broke it, the GGUF is still there
        log.warning("weight cache entry %s unreadable (%s: %s); removing it", entry,
                    type(e).__name__, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def read_float32(f: Any) -> dict[str, torch.Tensor]:
    """Every tensor of an open safetensors file (`safe_open`) as float32, copied out of the
    file's mapping: tensors in a safetensors file sit at any multiple of their element
    size, and a float32 weight used as loaded (no dtype conversion) then had rows off
    64-byte lines (measured: the float32 burst 0.78x vLLM against 0.92-0.96x read from the
    GGUF); torch's allocator aligns each copy to 64 bytes."""
    out = {}
    for key in f.keys():
        t = f.get_tensor(key)
        out[key] = t.float() if t.dtype != torch.float32 else t.clone()
    return out


def _read_entry(entry: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    from pdserve.engine.llama_config import model_config

    with safe_open(str(entry / WEIGHTS_FILE), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get(_ALIASES, "{}"))
        state = read_float32(f)
    for alias, key in aliases.items():
        state[alias] = state[key]
    return model_config(entry), state


def store(entry: Path, config: Any, state: dict[str, torch.Tensor]) -> bool:
    """Write `state` and `config` as the cache entry `entry` (`cache_key_dir`); False
    (logged) when the cache cannot be written, which costs only the next load's time."""
    from safetensors.torch import save_file

    owner: dict[tuple[int, int, tuple[int, ...]], str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for k, v in state.items():
        ident = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if ident in owner:
            aliases[k] = owner[ident]
        else:
            owner[ident] = k
            unique[k] = v.contiguous()

    def fill(tmp: str) -> None:
        save_file(unique, os.path.join(tmp, WEIGHTS_FILE),
                  metadata={_ALIASES: json.dumps(aliases)})
        config.save_pretrained(tmp)

    try:
        publish_dir(entry, fill)
    except OSError as e:
        log.warning("could not cache de-quantized weights in %s: %s", entry, e)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.engine.weight_cache",
        description="De-quantize a GGUF model's weights once into the weight cache, so that "
                    "every later load (a worker's start, a restart) reads them in seconds. A "
                    "Hugging Face directory needs no cache: nothing is done.")
    p.add_argument("model", help="model alias, .gguf file, or directory holding a .gguf")
    a = p.parse_args(argv)
    from pdserve.engine.model_loader import load_hf_weights

    source: ModelSource = resolve_model(a.model)
    if not source.gguf_file:
        print(f"{a.model}: not a GGUF model; its weights are read directly", file=sys.stderr)
        return 0
    load_hf_weights(source)
    print(cache_key_dir(os.path.join(source.directory, source.gguf_file)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
