"""A float32 model's projections kept in the GGUF Q4_1 blocks they were de-quantized from,
for the CPU decode stack's GEMV to stream (pdserve/engine/cpu_kernels/q4_blocks.c).

The default model ships as a Q4_1 GGUF; the loader de-quantizes it to float32, and every
value of those weights is d * q + m for its block's scale and offset, exact in float32. A
batch-1 decode step is bound by streaming the weights from memory, and the blocks are 0.625
bytes a weight against 4: the same weights, bit for bit, in a sixth of the bytes.

"Bit for bit" is checked, not assumed: each fused projection (qkv, o, gate_up, down) of each
layer is matched row by row against the model's float32 tensor (transformers re-orders the
rows of q and k for its RoPE layout; rows are matched wherever they moved). A projection
with a row that matches nothing, a tensor of another GGUF type, or a K not a multiple of
32, and the model gets no blocks at all: the decode stack then streams the float32 rows as
before.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from pdserve.engine.model_files import gguf_index

log = logging.getLogger(__name__)

BLOCK = 32  # weights per Q4_1 block
BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of 4-bit codes
Q4_1 = 3  # its GGML type number

# the fused projections of pdserve.engine.llama.LayerWeights, from the GGUF's tensors
FUSED = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
         "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}


def dequantize(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [N, K / 32 * 20] Q4_1 rows -> float32 [N, K], as the loader computes them (in
    C: q4_blocks.c's q41_dequant)."""
    from pdserve.engine.cpu_kernels.library import load

    blocks = blocks.contiguous()
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    load().q41_dequant(blocks.data_ptr(), blocks.shape[0], k, out.data_ptr())
    return out


def _row_order(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """The permutation p with rows[p] == weight bit for bit, or None where a row of weight
    has no equal in rows."""
    if torch.equal(weight, rows):
        return torch.arange(weight.shape[0])
    # rows found by their first values' bits, then compared whole
    def key(t: torch.Tensor) -> list[bytes]:
        head = t[:, :16].contiguous().numpy()
        return [r.tobytes() for r in head]

    where = {h: i for i, h in enumerate(key(rows))}
    order = [where.get(h) for h in key(weight)]
    if any(i is None for i in order):
        return None
    perm = torch.tensor(order)
    return perm if torch.equal(rows[perm], weight) else None


def layer_blocks(gguf_path: str | os.PathLike, model: Any) -> list[dict[str, torch.Tensor]] | None:
    """Per layer, each fused projection's Q4_1 rows (uint8 [N, K / 32 * 20], in the order of
    the model's float32 rows), or None where the model cannot use them (module doc)."""
    if model.dtype != torch.float32 or model.quantization is not None:
        return None
    tensors = gguf_index(gguf_path).tensors
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    out = []
    for i, layer in enumerate(model.layers):
        fused: dict[str, torch.Tensor] = {}
        for name, parts in FUSED.items():
            weight = getattr(layer, name)
            k = weight.shape[1]
            pieces = []
            for part in parts:
                t = tensors.get(f"blk.{i}.{part}.weight")
                if t is None or t.ggml_type != Q4_1 or k % BLOCK or t.dims[0] != k:
                    log.info("no Q4_1 blocks: blk.%d.%s is %s", i, part,
                             "missing" if t is None else f"GGML type {t.ggml_type} {t.dims}")
                    return None
                n_rows = int(np.prod(t.dims[1:]))
                size = n_rows * (k // BLOCK) * BLOCK_BYTES
                pieces.append(torch.from_numpy(np.array(data[t.offset:t.offset + size]))
                              .reshape(n_rows, -1))
            rows = torch.cat(pieces)
            if rows.shape[0] != weight.shape[0]:
                return None
            order = _row_order(weight, dequantize(rows, k))
            if order is None:
                log.info("no Q4_1 blocks: layer %d %s is not its GGUF blocks' values", i, name)
                return None
            fused[name] = rows[order].contiguous()
        out.append(fused)
    return out
