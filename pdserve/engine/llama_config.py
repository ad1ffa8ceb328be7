"""A Llama model's config.json read without transformers, where that gives what transformers'
`LlamaConfig` would: the fields the engine reads (`LlamaDims`, RoPE, tied embeddings, eos),
with `LlamaConfig`'s defaults for those a file leaves out. Anything else (another model
type, scaled or partial RoPE, per-layer RoPE) goes through `AutoConfig`, as before.

Why: a worker reads its config at every start, and with torch installed, importing
transformers' config classes pulls in its model-loading and distributed-tensor modules
(~2 s on a 2-core machine, more when several workers start at once). A worker restarting
after a crash, or one the planner adds, pays that on the request path of a recovery.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# transformers' LlamaConfig defaults, for the fields read here
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "eos_token_id": 2,
    "tie_word_embeddings": False, "head_dim": None,
}
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class PlainLlamaConfig:
    """The config attributes the engine reads, named as transformers names them."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    eos_token_id: int | list[int] | None
    tie_word_embeddings: bool
    rope_parameters: dict[str, Any] = field(default_factory=dict)


def read_llama_config(directory: str | Path) -> PlainLlamaConfig | None:
    """The config of the Hugging Face directory `directory`, or None where it is not a
    plain Llama one (see the module docstring) or has no readable config.json."""
    try:
        raw = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") != "llama":
        return None
    # transformers: a legacy rope_scaling replaces rope_parameters; the theta comes from
    # the parameters, else the top level, else the default
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or raw.get("layer_types") is not None:
        return None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default" or "partial_rotary_factor" in params or (
            "partial_rotary_factor" in raw):
        return None
    theta = params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    v = {k: raw.get(k, d) for k, d in _DEFAULTS.items()}
    heads = v["num_attention_heads"]
    return PlainLlamaConfig(
        vocab_size=v["vocab_size"], hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"], num_hidden_layers=v["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=v["num_key_value_heads"] or heads,
        head_dim=v["head_dim"] or v["hidden_size"] // heads,
        max_position_embeddings=v["max_position_embeddings"], rms_norm_eps=v["rms_norm_eps"],
        eos_token_id=v["eos_token_id"], tie_word_embeddings=bool(v["tie_word_embeddings"]),
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)})


def model_config(directory: str | Path) -> Any:
    """The config of a Hugging Face directory: `read_llama_config`'s where it applies,
    else transformers' `AutoConfig`."""
    plain = read_llama_config(directory)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory))
