"""A model's projections kept in the GGUF Q4_1 blocks they were de-quantized from, and its LM
head in its Q8_0 blocks, for the CPU decode stack's GEMV to stream
(pdserve/engine/cpu_kernels/q4_blocks.c).

The default model ships as a Q4_1 GGUF; the loader de-quantizes it to float32, and every
value of those weights is d * q + m for its block's scale and offset, exact in float32. A
batch-1 decode step is bound by streaming the weights from memory, and the blocks are 0.625
bytes a weight against 4: the same weights, bit for bit, in a sixth of the bytes. The
head (the tied embedding, Q8_0: d * q with int8 q) is 1.06 bytes a weight. A bfloat16 model
holds those values rounded to bfloat16 (2 bytes a weight), and the kernels round them the
same way.

"Bit for bit" is checked, not assumed: each fused projection (qkv, o, gate_up, down) of each
layer is matched row by row against the model's tensor (transformers re-orders the
rows of q and k for its RoPE layout; rows are matched wherever they moved). A projection
with a row that matches nothing, a tensor of another GGUF type, or a K not a multiple of
32, and the model gets no blocks at all: the decode stack then streams its rows as before.
A head that does not match keeps its rows alone. Nor does a model get blocks from a build
without their vector form for its dtype (`blocks_fast`: float32 on AVX-512 with VBMI or on
AVX2 with FMA and F16C; bfloat16 on AVX512-BF16), where streaming them would be slower than
the rows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.engine.model_files import gguf_index

log = logging.getLogger(__name__)

BLOCK = 32  # weights per block
# Rows of a float32 decode step the GEMV takes over the blocks (the row GEMV stops at
# GEMV_MAX_ROWS): past 4 rows the blocks' GEMV stays cheaper than the packed panels, which
# stream the float32 rows (538 MB a step). A whole decode step on the default model, two
# threads, blocks against panels: 5 rows 13.4-14.2 ms against 20.9-22.8, 6 rows 15.2-16.8
# against 21.8-22.6, 8 rows 17.6-19.5 against 22.4-22.7, 10 rows (two passes) 28.9-30.2
# against 21.9-23.1 (docs/benchmarks.md section 6, session 24). A bfloat16 model's panels
# stream half the bytes and win from 5 rows (11.2-13.2 ms against 13.0-16.6). On a Zen 3
# (AVX2), blocks against rows (row GEMV to 4 rows, panels past): 1 row 10.5 ms against
# 22.2-26.1, 4 rows 17.5-19.0 against 29.7-32.8, 8 rows 31.7-34.3 against 55.5-55.7, 10 rows
# 57.1-66.7 against 63.1-67.4 (docs/benchmarks.md section 6, session 27).
F32_GEMV_MAX_ROWS = 8


def gemv_rows(dtype: torch.dtype) -> int:
    """The most rows of a decode step the GEMV takes over a model's blocks: F32_GEMV_MAX_ROWS
    for float32, the row GEMV's elsewhere (GEMV_MAX_ROWS)."""
    from pdserve.engine.layers.linear import GEMV_MAX_ROWS

    return F32_GEMV_MAX_ROWS if dtype == torch.float32 else GEMV_MAX_ROWS


# GGML type -> (bytes a block, the C kernels' format code: common.h's BLOCKS_*)
Q4_1, Q8_0 = 3, 8
FORMATS = {Q4_1: (20, 1),  # float16 d, float16 m, 16 bytes of 4-bit codes
           Q8_0: (34, 2)}  # float16 d, 32 int8 codes

# the fused projections of pdserve.engine.llama.LayerWeights, from the GGUF's tensors
FUSED = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
         "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}


def row_bytes(k: int, ggml_type: int) -> int:
    """Bytes of one row of k weights as blocks of `ggml_type` (Q4_1 or Q8_0)."""
    return k // BLOCK * FORMATS[ggml_type][0]


@dataclass(frozen=True)
class GgufBlocks:
    """What the decode stack streams instead of the model's rows."""

    layers: list[dict[str, torch.Tensor]]  # per layer, each fused projection's Q4_1 rows
    head: torch.Tensor | None  # the LM head's Q8_0 rows, or None (its own rows then)

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() for layer in self.layers for t in layer.values())
        return n + (self.head.numel() if self.head is not None else 0)


def dequantize(blocks: torch.Tensor, k: int, ggml_type: int = Q4_1) -> torch.Tensor:
    """uint8 [N, K / 32 * block bytes] rows -> float32 [N, K], as the loader computes them
    (in C: q4_blocks.c's blocks_dequant)."""
    from pdserve.engine.cpu_kernels.library import load

    blocks = blocks.contiguous()
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    load().blocks_dequant(blocks.data_ptr(), FORMATS[ggml_type][1], blocks.shape[0], k,
                          out.data_ptr())
    return out


def _row_order(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """The permutation p with rows[p] == weight bit for bit, or None where a row of weight
    has no equal in rows."""
    if torch.equal(weight, rows):
        return torch.arange(weight.shape[0])
    # rows found by their first values' bits, then compared whole
    def key(t: torch.Tensor) -> list[bytes]:
        head = t[:, :16].contiguous().view(torch.uint8).numpy()
        return [r.tobytes() for r in head]

    where = {h: i for i, h in enumerate(key(rows))}
    order = [where.get(h) for h in key(weight)]
    if any(i is None for i in order):
        return None
    perm = torch.tensor(order)
    return perm if torch.equal(rows[perm], weight) else None


def _rows(data: np.ndarray, t: Any, k: int) -> torch.Tensor:
    """A 2-D tensor's blocks from the mapped file, uint8 [rows, K / 32 * block bytes]."""
    n_rows = int(np.prod(t.dims[1:]))
    size = n_rows * row_bytes(k, t.ggml_type)
    return torch.from_numpy(np.array(data[t.offset:t.offset + size])).reshape(n_rows, -1)


def model_blocks(gguf_path: str | os.PathLike, model: Any) -> GgufBlocks | None:
    """The blocks of a model loaded from `gguf_path`, or None where its projections are not
    all Q4_1 blocks' values, or this build would not gain (module doc)."""
    from pdserve.engine.cpu_kernels.library import DTYPE_CODES, load

    if (model.dtype not in DTYPE_CODES or model.quantization is not None
            or not load().blocks_fast(DTYPE_CODES[model.dtype])):
        return None
    tensors = gguf_index(gguf_path).tensors
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    layers = []
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
                pieces.append(_rows(data, t, k))
            rows = torch.cat(pieces)
            if rows.shape[0] != weight.shape[0]:
                return None
            order = _row_order(weight, dequantize(rows, k).to(weight.dtype))
            if order is None:
                log.info("no Q4_1 blocks: layer %d %s is not its GGUF blocks' values", i, name)
                return None
            fused[name] = rows[order].contiguous()
        layers.append(fused)
    return GgufBlocks(layers, _head_blocks(tensors, data, model.lm_head))


def _head_blocks(tensors: dict[str, Any], data: np.ndarray, head: torch.Tensor
                 ) -> torch.Tensor | None:
    """The LM head's Q8_0 rows (its own tensor, or the tied embedding's) where they hold its
    values in its row order, else None."""
    k = head.shape[1]
    for name in ("output.weight", "token_embd.weight"):
        t = tensors.get(name)
        if (t is not None and t.ggml_type == Q8_0 and not k % BLOCK and t.dims[0] == k
                and int(np.prod(t.dims[1:])) == head.shape[0]):
            rows = _rows(data, t, k)
            if torch.equal(dequantize(rows, k, Q8_0).to(head.dtype), head):
                return rows
    return None
