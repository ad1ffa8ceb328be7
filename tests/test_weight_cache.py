"""The GGUF weight cache (pdserve.engine.weight_cache): what goes in comes back, tied
tensors stay tied, the key follows the file's content, and the real model's entry holds
what transformers reads from the GGUF."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from pdserve.engine import weight_cache
from pdserve.engine.cpu_kernels import build
from pdserve.engine.llama import LlamaDims


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setattr(build, "cache_dir", lambda: root)
    return root


def _state() -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(32, 8, generator=g)
    state = {"model.embed_tokens.weight": embed,
             "model.layers.0.mlp.down_proj.weight": torch.randn(8, 16, generator=g),
             "model.norm.weight": torch.ones(8),
             "lm_head.weight": embed}  # tied, as SmolLM2's is
    cfg = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return cfg, state


def test_round_trip_keeps_values_ties_and_config(tmp_path, cache_root):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(1000))
    assert weight_cache.load_cached(weight_cache.cache_key_dir(gguf)) is None
    cfg, state = _state()
    assert weight_cache.store(weight_cache.cache_key_dir(gguf), cfg, state)
    got_cfg, got = weight_cache.load_cached(weight_cache.cache_key_dir(gguf))
    assert set(got) == set(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
    # in the process's own memory, each on a 64-byte line (the GEMV streams rows of them)
    assert all(v.data_ptr() % 64 == 0 for v in got.values())
    # the entry's config.json is the whole config; the engine reads its Llama fields plainly
    entry = weight_cache.cache_key_dir(gguf)
    assert AutoConfig.from_pretrained(str(entry)).to_dict() | {"_name_or_path": ""} == \
        cfg.to_dict() | {"_name_or_path": ""}
    assert LlamaDims.from_hf_config(got_cfg) == LlamaDims.from_hf_config(cfg)
    # the tied tensor is stored once
    entry = weight_cache.cache_key_dir(gguf) / weight_cache.WEIGHTS_FILE
    assert entry.stat().st_size < 2 * 32 * 8 * 4 + 8 * 16 * 4 + 8 * 4 + 4096


def test_key_follows_content_not_name(tmp_path, cache_root):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(b"GGUF same bytes")
    b.write_bytes(b"GGUF same bytes")
    c.write_bytes(b"GGUF other bytes")
    cfg, state = _state()
    weight_cache.store(weight_cache.cache_key_dir(a), cfg, state)
    # another path, the same weights
    assert weight_cache.load_cached(weight_cache.cache_key_dir(b)) is not None
    assert weight_cache.load_cached(weight_cache.cache_key_dir(c)) is None


def test_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")  # the cache root is a file: nothing can be created under it
    monkeypatch.setattr(build, "cache_dir", lambda: blocker)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cfg, state = _state()
    assert weight_cache.store(weight_cache.cache_key_dir(gguf), cfg, state) is False
    assert weight_cache.load_cached(weight_cache.cache_key_dir(gguf)) is None


@pytest.mark.slow
def test_real_entry_matches_the_gguf(smollm2_hf):
    """The default model's entry (made by `make venv` or the first load) against
    transformers reading the GGUF itself."""
    from pdserve.engine.model_files import resolve_model
    from pdserve.engine.model_loader import load_hf_weights

    src = resolve_model("smollm2-135m")
    load_hf_weights(src, show_progress=False)  # fills the cache if it is empty
    cached = weight_cache.load_cached(
        weight_cache.cache_key_dir(os.path.join(src.directory, src.gguf_file)))
    assert cached is not None
    ref = smollm2_hf.state_dict()
    assert set(cached[1]) == set(ref)
    for k, v in ref.items():
        assert torch.equal(cached[1][k], v), k
    entry = weight_cache.cache_key_dir(os.path.join(src.directory, src.gguf_file))
    assert AutoConfig.from_pretrained(str(entry)).to_dict() | {"_name_or_path": ""} == \
        smollm2_hf.config.to_dict() | {"_name_or_path": ""}
    assert LlamaDims.from_hf_config(cached[0]) == LlamaDims.from_hf_config(smollm2_hf.config)


def test_damaged_entry_is_removed_and_written_again(tmp_path, cache_root, caplog):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF damaged later")
    cfg, state = _state()
    entry = weight_cache.cache_key_dir(gguf)
    assert weight_cache.store(entry, cfg, state)
    (entry / weight_cache.WEIGHTS_FILE).write_bytes(b"\x08not a safetensors file")
    with caplog.at_level("WARNING", logger="pdserve.engine"):
        assert weight_cache.load_cached(entry) is None
    assert "unreadable" in caplog.text and not entry.exists()
    assert weight_cache.store(entry, cfg, state)  # the next load's store replaces it
    got = weight_cache.load_cached(entry)[1]
    assert torch.equal(got["model.norm.weight"], state["model.norm.weight"])
