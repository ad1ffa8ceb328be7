"""Reading a Hugging Face directory without building transformers' model: the state dict
and config must be what transformers loads, the tensors float32 and 64-byte aligned; the
RoPE tables' parameters must be what transformers' LlamaRotaryEmbedding computes."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llama import LlamaDims, rope_parameters
from pdserve.engine.model_files import resolve_model
from pdserve.engine.model_loader import load_hf_weights


def test_safetensors_directory_reads_as_transformers_does(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config, state = load_hf_weights(resolve_model(tiny_model_dir), show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    want = hf.state_dict()
    assert set(state) == set(want)
    for k, v in state.items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k]), k
        assert v.data_ptr() % 64 == 0, k
    # read without transformers (test_llama_config holds it to AutoConfig field by field)
    assert LlamaDims.from_hf_config(config) == LlamaDims.from_hf_config(hf.config)
    # a bfloat16 checkpoint comes back widened to float32
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    _, half = load_hf_weights(resolve_model(str(tmp_path)), show_progress=False)
    k = "model.layers.0.mlp.down_proj.weight"
    assert half[k].dtype == torch.float32 and torch.equal(half[k], want[k].bfloat16().float())


@pytest.mark.parametrize("extra", [
    {}, {"rope_theta": 500000.0},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_theta": 500000.0, "max_position_embeddings": 16384,
     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
])
def test_rope_parameters_are_transformers(extra):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, **extra)
    rope = LlamaRotaryEmbedding(cfg)
    inv_freq, scaling = rope_parameters(cfg, 16)
    assert torch.equal(inv_freq, rope.inv_freq.float())
    assert scaling == float(rope.attention_scaling)
