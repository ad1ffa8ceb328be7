"""A worker's config and tokenizer without transformers' heavy imports
(pdserve.engine.llama_config, model_files' tokenizer path): the same values transformers
gives, and the fallback to it wherever the plain reading does not apply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from pdserve.engine import weight_cache
from pdserve.engine.llama import LlamaDims, rope_parameters
from pdserve.engine.llama_config import PlainLlamaConfig, model_config, read_llama_config
from pdserve.engine.model_files import (
    ModelSource,
    chat_text,
    eos_token_ids,
    gguf_export_dir,
    load_tokenizer,
    resolve_model,
)

BASE = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512}


def _same_as_transformers(directory: str) -> PlainLlamaConfig:
    plain = read_llama_config(directory)
    assert isinstance(plain, PlainLlamaConfig), directory
    hf = AutoConfig.from_pretrained(directory)
    assert LlamaDims.from_hf_config(plain) == LlamaDims.from_hf_config(hf)
    d = LlamaDims.from_hf_config(hf).head_dim
    (inv_p, scale_p), (inv_h, scale_h) = rope_parameters(plain, d), rope_parameters(hf, d)
    assert torch.equal(inv_p, inv_h) and scale_p == scale_h
    assert plain.tie_word_embeddings == bool(getattr(hf, "tie_word_embeddings", False))
    source = ModelSource(directory, directory)
    assert eos_token_ids(plain, None, source) == eos_token_ids(hf, None, source)
    return plain


def _write(tmp_path: Path, name: str, config: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def test_plain_config_matches_transformers(tiny_model_dir, tmp_path):
    _same_as_transformers(tiny_model_dir)
    # the old layout: theta at the top level, kv heads and head_dim left to the defaults
    legacy = _write(tmp_path, "legacy", {**BASE, "rope_theta": 500000.0, "rope_scaling": None,
                                         "eos_token_id": [5, 7], "tie_word_embeddings": True})
    plain = _same_as_transformers(legacy)
    assert (plain.num_key_value_heads, plain.head_dim) == (4, 16)
    assert plain.rope_parameters["rope_theta"] == 500000.0
    # nothing but the shapes: transformers' defaults for everything else
    bare = _same_as_transformers(_write(tmp_path, "bare", BASE))
    assert (bare.rms_norm_eps, bare.eos_token_id, bare.tie_word_embeddings) == (1e-6, 2, False)
    smollm2 = resolve_model("smollm2-135m")
    for d in (gguf_export_dir(os.path.join(smollm2.directory, smollm2.gguf_file)),
              weight_cache.cache_key_dir(os.path.join(smollm2.directory, smollm2.gguf_file))):
        if d.is_dir():  # made by the Makefile's setup
            assert _same_as_transformers(str(d)).num_key_value_heads == 3


def test_what_the_plain_reading_leaves_to_transformers(tmp_path):
    scaled = _write(tmp_path, "llama3", {**BASE, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}})
    other = _write(tmp_path, "mistral", {**BASE, "model_type": "mistral"})
    partial = _write(tmp_path, "partial", {**BASE, "partial_rotary_factor": 0.5})
    for d in (scaled, other, partial):
        assert read_llama_config(d) is None
        assert not isinstance(model_config(d), PlainLlamaConfig)
    assert model_config(scaled).rope_parameters["rope_type"] == "llama3"
    assert read_llama_config(tmp_path / "missing") is None


def test_tokenizer_through_its_named_class_is_autotokenizers(tiny_model_dir):
    ours = load_tokenizer(resolve_model(tiny_model_dir))
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(ours) is type(auto) and type(ours).__name__ == "TokenizersBackend"
    texts = ["Hello world", "café 😀 naïve", "<|im_start|>user\nhi<|im_end|>", " x  y\t"]
    assert [ours.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    ids = auto.encode(texts[1] + texts[2])
    assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert chat_text(ours, messages) == chat_text(auto, messages)
    assert (ours.eos_token_id, ours.all_special_ids) == (auto.eos_token_id, auto.all_special_ids)


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_a_worker_reads_config_and_tokenizer_without_the_model_classes(tiny_model_dir, model):
    """In a fresh interpreter with torch loaded, as a worker: the config and tokenizer of
    the tiny model and of the default GGUF come without transformers' auto-class tables
    and config validators (the ~2 s import), and the GGUF's tokenizer from its export."""
    code = (
        "import json, sys, torch\n"
        "from pdserve.engine.model_files import resolve_model, load_tokenizer\n"
        "from pdserve.engine.model_loader import load_hf_weights\n"
        "s = resolve_model(sys.argv[1])\n"
        "cfg, _ = load_hf_weights(s, show_progress=False)\n"
        "tok = load_tokenizer(s)\n"
        "print(json.dumps({'config': type(cfg).__name__, 'tokenizer': type(tok).__name__,\n"
        "    'heavy': sorted(m for m in ('transformers.utils.type_validators',\n"
        "        'transformers.models.auto.tokenization_auto',\n"
        "        'transformers.models.llama.configuration_llama') if m in sys.modules)}))\n")
    name = tiny_model_dir if model == "tiny" else model
    out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"config": "PlainLlamaConfig", "tokenizer": "TokenizersBackend",
                   "heavy": []}, out.stderr[-2000:]
