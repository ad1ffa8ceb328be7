"""The Llama-family forward pass over a flat, unpadded batch and a paged KV cache.

One call runs T tokens from many sequences at once (varlen): no padding, one big matmul per
projection. Q/K/V and gate/up projections are fused into single weights at load time.
Logits are computed only for the rows the caller samples from. The layer ops (norm, RoPE,
activation, projections) come from pdserve.engine.layers.registry, per device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.config import QUANTIZATIONS
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.layers.int8 import Int8Weight, int8_linear, quantize_int8
from pdserve.engine.layers.registry import layer_ops


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
    # quantization "int8": the four projections as int8 (the tensors above then hold their
    # de-quantized values, for the paths that do not read int8)
    int8: dict[str, Int8Weight] = field(default_factory=dict)


PROJECTIONS = ("qkv", "o", "gate_up", "down")


LayerHook = Callable[[int], None]


def rope_parameters(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention scaling) of the model's RoPE, as
    transformers' LlamaRotaryEmbedding computes them: the plain formula for the default
    type, transformers' own functions for the scaled ones (llama3, yarn, ...). Not through
    the class: importing transformers' Llama modeling code cost ~2 s at every worker
    start."""
    params = getattr(hf_config, "rope_parameters", None) or {
        "rope_type": (getattr(hf_config, "rope_scaling", None) or {}).get("rope_type",
                                                                         "default"),
        "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    if params.get("rope_type", "default") == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv.float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config)
    return inv.float(), float(scaling)


class LlamaModel:
    """Weights + forward. Not an nn.Module: nothing here is trained."""

    def __init__(self, dims: LlamaDims, state: dict[str, torch.Tensor], hf_config: Any,
                 dtype: torch.dtype, device: torch.device,
                 quantization: str | None = None) -> None:
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got "
                             f"{quantization!r}")
        self.dims = dims
        self.dtype = dtype
        self.device = device
        self.quantization = quantization

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in state and not getattr(
            hf_config, "tie_word_embeddings", False) else self.embed
        self.final_norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(dims.num_layers):
            p = f"model.layers.{i}."
            # the projections as loaded (float32 from the loader): quantized from these, not
            # from their model-dtype copies
            full = {
                "qkv": torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                "o": state[p + "self_attn.o_proj.weight"],
                "gate_up": torch.cat([state[p + "mlp.gate_proj.weight"],
                                      state[p + "mlp.up_proj.weight"]]),
                "down": state[p + "mlp.down_proj.weight"],
            }
            int8 = ({n: quantize_int8(t) for n, t in full.items()}
                    if quantization == "int8" else {})
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                int8=int8,
                **{n: (int8[n].dequantize(dtype) if int8 else t.to(dtype)).to(
                    device).contiguous() for n, t in full.items()},
            ))
        # quantization "int8": the LM head's int8 copy, read by the decode stack's logits.
        # The model-dtype head is its de-quantized value, so every path computes with the
        # same weights; a tied embedding is the head and is de-quantized with it.
        self.lm_head_int8: Int8Weight | None = None
        if quantization == "int8":
            tied = self.lm_head is self.embed
            head = state["model.embed_tokens.weight" if tied else "lm_head.weight"]
            self.lm_head_int8 = quantize_int8(head)
            self.lm_head = self.lm_head_int8.dequantize(dtype).to(device)
            if tied:
                self.embed = self.lm_head
        self._init_rope(hf_config)
        # the per-device ops (C on the CPU, Triton on CUDA, else eager torch)
        self.ops = layer_ops(device)
        # x @ W^T: the ops' linear, or the int8 GEMV for a few rows of an int8 model (the
        # decode stack's arithmetic, so a step's rows get the same logits either way)
        self.linear = self.ops.linear
        if self.lm_head_int8 is not None and self.ops.name == "cpu":
            by_id = {id(getattr(lw, n)): lw.int8[n] for lw in self.layers for n in PROJECTIONS}
            by_id[id(self.lm_head)] = self.lm_head_int8
            self.linear = int8_linear(self.ops.linear, by_id)
        if self.ops.name == "cpu":
            # the copies the CPU linears keep (oneDNN's blocked weights, the batched kernels'
            # packing) now, rather than in the first steps requests wait on: ~0.15-0.3 s
            # for 135M parameters
            from pdserve.engine.layers.linear import prepack_cpu_copies

            prepack_cpu_copies(self.linear, [getattr(lw, n) for lw in self.layers
                                             for n in PROJECTIONS] + [self.lm_head])
        # the model's weights as the GGUF blocks they came from, for the decode stack
        # (pdserve.engine.gguf_blocks.GgufBlocks; set by the engine where it has them)
        self.gguf_blocks: Any = None
        self._decode_stack: tuple[PagedKVCache, Any] | None = None

    def _init_rope(self, hf_config: Any) -> None:
        inv_freq, scaling = rope_parameters(hf_config, self.dims.head_dim)
        pos = torch.arange(self.dims.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
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
        stack = self._stack_for(t, kv_cache, meta, backend, layer_hook)
        if stack is not None:
            logits = stack.run(self.embed[input_ids], positions, meta.slot_mapping,
                               meta.seq_lens, meta.block_tables)
            # every row of a pure decode samples, in row order: no vocab-wide gather then
            if logits_indices.numel() != t:
                logits = logits[logits_indices]
            return logits.float()
        q_size, kv_size = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        scale = d.head_dim ** -0.5
        ops, eps = self.ops, d.rms_norm_eps
        linear = self.linear
        rope = ops.rope_tables(positions, self.cos, self.sin)
        x = self.embed[input_ids]  # [T, H], the residual stream, updated in place
        h = ops.add_rms_norm(x, None, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            qkv = linear(h, layer.qkv)
            # RoPE on Q and K heads together: one pass instead of two
            qk = ops.rope(qkv[:, :q_size + kv_size].view(t, d.num_heads + d.num_kv_heads,
                                                         d.head_dim), rope)
            q, k = qk[:, :d.num_heads], qk[:, d.num_heads:]
            v = qkv[:, q_size + kv_size:].view(t, d.num_kv_heads, d.head_dim)
            k_cache, v_cache = kv_cache.key(i), kv_cache.value(i)
            backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = backend.forward(q, k_cache, v_cache, meta, scale)  # [T, Hq, D]
            h = ops.add_rms_norm(x, linear(attn.reshape(t, q_size), layer.o), layer.post_norm,
                                 eps)
            mlp = linear(ops.silu_mul(linear(h, layer.gate_up)), layer.down)
            if layer_hook is not None:
                layer_hook(i)
            if i + 1 < len(self.layers):
                h = ops.add_rms_norm(x, mlp, self.layers[i + 1].input_norm, eps)
        # the last layer's residual add only for the rows logits are computed for
        x = ops.add_rms_norm(x[logits_indices], mlp[logits_indices], self.final_norm, eps)
        return linear(x, self.lm_head).float()

    def _stack_for(self, t: int, kv_cache: PagedKVCache, meta: AttentionMetadata,
                   backend: AttentionBackend, layer_hook: LayerHook | None) -> Any:
        """The C decode stack (pdserve.engine.cpu_kernels.decode_stack) when this step can
        take it: C layer ops and C attention, a pure decode of at most the stack's max_rows
        rows, no layer hook, no padded row; else None (the layer loop below)."""
        from pdserve.engine.layers.linear import BATCH_MAX_ROWS

        if (self.ops.name != "cpu" or backend.name != "cpu" or layer_hook is not None
                or t > BATCH_MAX_ROWS or meta.num_decodes != t or t == 0):
            return None
        if self._decode_stack is None or self._decode_stack[0] is not kv_cache:
            from pdserve.engine.cpu_kernels.decode_stack import CpuDecodeStack

            try:
                self._decode_stack = (kv_cache, CpuDecodeStack(self, kv_cache.data))
            except ValueError:  # a layout the stack does not take: the loop, every step
                self._decode_stack = (kv_cache, None)
        stack = self._decode_stack[1]
        if stack is None or t > stack.max_rows or int(meta.slot_mapping.min()) < 0:
            return None
        return stack
