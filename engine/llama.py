"""The Llama-family forward pass over a flat, unpadded batch and a paged KV cache.

One call runs T tokens from many sequences at once (varlen): no padding, one big matmul per
projection. Q/K/V and gate/up projections are fused into single weights at load time.
Logits are computed only for the rows the caller samples from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.kv_cache import PagedKVCache


@dataclass(frozen=True)
class LlamaDims:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position: int

    @staticmethod
    def from_hf_config(cfg: Any) -> LlamaDims:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return LlamaDims(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position=cfg.max_position_embeddings,
        )


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    o: torch.Tensor  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


LayerHook = Callable[[int], None]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN's matmul. On the CPU `F.linear` in float32 goes to MKL's
    sgemm, which re-packs the weight on every call: 1.2-2.5x slower at decode batch sizes
    (up to 4x for the LM head), measured in docs/benchmarks.md section 1."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def pick_linear(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        return onednn_linear
    return F.linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # computed in float32 like the reference implementation, then cast back
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Llama / transformers convention); cos/sin broadcast to x."""
    return x * cos + _rotate_half(x) * sin


class LlamaModel:
    """Weights + forward. Not an nn.Module: nothing here is trained."""

    def __init__(self, dims: LlamaDims, state: dict[str, torch.Tensor], hf_config: Any,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.dims = dims
        self.dtype = dtype
        self.device = device

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in state and not getattr(
            hf_config, "tie_word_embeddings", False) else self.embed
        self.final_norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(dims.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
            gate_up = torch.cat([state[p + "mlp.gate_proj.weight"],
                                 state[p + "mlp.up_proj.weight"]], dim=0)
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=qkv.to(device=device, dtype=dtype).contiguous(),
                o=w(p + "self_attn.o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=gate_up.to(device=device, dtype=dtype).contiguous(),
                down=w(p + "mlp.down_proj.weight"),
            ))
        self._init_rope(hf_config)
        self.linear = pick_linear(device)

    def _init_rope(self, hf_config: Any) -> None:
        # The model's own RoPE parameters (theta, scaling type) as transformers computes them.
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(hf_config)
        inv_freq = rope.inv_freq.float()
        pos = torch.arange(self.dims.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = float(rope.attention_scaling)
        # [max_position, D] each
        self.cos = (emb.cos() * scaling).to(device=self.device, dtype=self.dtype)
        self.sin = (emb.sin() * scaling).to(device=self.device, dtype=self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # [S] rows to compute logits for
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Logits [S, vocab] (float32) for the selected rows."""
        d = self.dims
        t = input_ids.shape[0]
        q_size, kv_size = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        scale = d.head_dim ** -0.5
        linear = self.linear
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        x = self.embed[input_ids]  # [T, H]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, d.rms_norm_eps)
            qkv = linear(h, layer.qkv)
            # RoPE on Q and K heads together: one pass instead of two
            qk = qkv[:, :q_size + kv_size].view(t, d.num_heads + d.num_kv_heads, d.head_dim)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :d.num_heads], qk[:, d.num_heads:]
            v = qkv[:, q_size + kv_size:].view(t, d.num_kv_heads, d.head_dim)
            k_cache, v_cache = kv_cache.key(i), kv_cache.value(i)
            backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = backend.forward(q, k_cache, v_cache, meta, scale)  # [T, Hq, D]
            x = x + linear(attn.reshape(t, q_size), layer.o)
            h = rms_norm(x, layer.post_norm, d.rms_norm_eps)
            gate_up = linear(h, layer.gate_up)
            inter = gate_up.shape[-1] // 2
            x = x + linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.down)
            if layer_hook is not None:
                layer_hook(i)
        x = rms_norm(x[logits_indices], self.final_norm, d.rms_norm_eps)
        return linear(x, self.lm_head).float()
