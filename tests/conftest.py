"""Shared fixtures: a tiny random-weight Llama (with the SmolLM2 tokenizer) and the real
SmolLM2-135M, each loaded once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_SEED = 1234


def make_tiny_model(path: str, vocab_size: int = 49152, num_kv_heads: int = 2) -> str:
    """A 2-layer GQA Llama with random weights and the real SmolLM2 tokenizer, saved as a
    Hugging Face directory (safetensors) — the same loading path as any local model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model_loader import load_tokenizer, resolve_model

    torch.manual_seed(TINY_SEED)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16,
        max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
    )
    model = LlamaForCausalLM(cfg)
    # random init gives near-uniform logits; widen them so greedy choices are decisive
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    if tok is not None:
        tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))
