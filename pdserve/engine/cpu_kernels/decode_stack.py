"""The Python side of decode_stack.c: `CpuDecodeStack`, every decoder layer of a CPU decode
step in one C call (the model's layer loop, kernel for kernel, without a Python dispatch
per kernel; over the int8 projections where the model is quantized, or the GGUF blocks the
model's weights came from, pdserve.engine.gguf_blocks). Up to GEMV_MAX_ROWS rows
(gguf_blocks.F32_GEMV_MAX_ROWS over a float32 model's blocks) the projections stream the
weights (the GEMV); batches up to BATCH_MAX_ROWS run over the packed copies the layer loop
also uses for them (`linear.batch_packed`: AMX tiles or bfloat16 panels, AVX512-BF16 or
AVX2, for bfloat16; AVX-512 or AVX2 panels for float32) where the machine and build have
those kernels.

Life cycle: built once per (model, KV cache) by the model, which checks there every
weight's shape, dtype and layout and the cache's; `run` then checks only what changes per
step (the rows' positions, slots, lengths and block tables; the C side re-checks positions
and slots as it reads them), so nothing reaches C that could read or write outside the
tensors given.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.engine import gguf_blocks
from pdserve.engine.cpu_kernels.library import DTYPE_CODES, load
from pdserve.engine.cpu_kernels.paged_decode import MAX_HEAD_DIM, check_tables
from pdserve.engine.layers.int8 import num_groups
from pdserve.engine.layers.linear import BATCH_MAX_ROWS, GEMV_MAX_ROWS, batch_packed


class DsModel(ctypes.Structure):
    """struct ds_model in decode_stack.c."""

    _fields_ = [(n, ctypes.c_int64) for n in (
        "L", "H", "Hq", "Hkv", "D", "I", "max_position", "block_size", "cache_layer_stride")
    ] + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("dt", ctypes.c_int),
         ("kv_dt", ctypes.c_int)]


class DsHead(ctypes.Structure):
    """struct ds_head in decode_stack.c: the LM head and where its logits go."""

    _fields_ = [("w", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("blocks", ctypes.c_void_p), ("packed", ctypes.c_void_p),
                ("V", ctypes.c_int64), ("logits", ctypes.c_void_p)]


_ERRORS = {-1: (MemoryError, "no memory for the decode stack's scratch buffers"),
           -2: (ValueError, "a position is outside the RoPE tables"),
           -3: (MemoryError, "the paged decode kernel could not allocate its scratch memory"),
           -4: (ValueError, "a slot is outside the KV cache"),
           -5: (RuntimeError, "the batched decode stack's kernel (AMX tiles or panels) is "
                              "missing from this build or machine"),
           -6: (ValueError, "GGUF blocks are read only without int8, by a build with their "
                            "vector form for the model's dtype")}


def _packed_pointers(layer_weights: list[torch.Tensor]) -> ctypes.Array | None:
    """Pointers to the packed copies of the model's projections (`batch_packed`, made at
    model load), None in each norm's place; None where the batched form cannot run (a
    projection without a packed copy: its dtype or shape, or no kernel here)."""
    packed = [batch_packed(t) if t.dim() == 2 else None for t in layer_weights]
    if any(p is None for t, p in zip(layer_weights, packed) if t.dim() == 2):
        return None
    return (ctypes.c_void_p * len(packed))(*(None if p is None else p.data_ptr()
                                             for p in packed))


def _block_pointers(model, want: dict[str, tuple[int, ...]]) -> ctypes.Array | None:
    """Pointers to the projections' Q4_1 blocks (`model.gguf_blocks`), None in each norm's
    place; None where the model has none."""
    if model.gguf_blocks is None:
        return None
    pointers = []
    for n, layer in enumerate(model.gguf_blocks.layers):
        for name, wshape in want.items():
            if len(wshape) == 1:
                pointers.append(None)
                continue
            t = layer[name]
            bshape = (wshape[0], gguf_blocks.row_bytes(wshape[1], gguf_blocks.Q4_1))
            if (t.dtype != torch.uint8 or tuple(t.shape) != bshape or not t.is_contiguous()
                    or t.device.type != "cpu" or wshape[1] % gguf_blocks.BLOCK):
                raise ValueError(f"layer {n} {name}'s Q4_1 blocks must be a contiguous uint8 "
                                 f"{bshape}")
            pointers.append(t.data_ptr())
    return (ctypes.c_void_p * len(pointers))(*pointers)


def _head_blocks(model) -> torch.Tensor | None:
    """The LM head's Q8_0 blocks (`model.gguf_blocks.head`), where the model has them."""
    blocks = model.gguf_blocks.head if model.gguf_blocks is not None else None
    if blocks is None:
        return None
    d = model.dims
    bshape = (d.vocab_size, gguf_blocks.row_bytes(d.hidden_size, gguf_blocks.Q8_0))
    if (blocks.dtype != torch.uint8 or tuple(blocks.shape) != bshape
            or not blocks.is_contiguous() or d.hidden_size % gguf_blocks.BLOCK):
        raise ValueError(f"the LM head's Q8_0 blocks must be a contiguous uint8 {bshape}")
    return blocks


class CpuDecodeStack:
    """All layers of a decode step for `model` (a pdserve.engine.llama.LlamaModel) over
    `kv_data` ([L, 2, num_blocks, block_size, Hkv, D], contiguous)."""

    def __init__(self, model, kv_data: torch.Tensor) -> None:
        d = model.dims
        dt = model.dtype
        if dt not in DTYPE_CODES or kv_data.dtype not in DTYPE_CODES:
            raise ValueError(f"model and cache must be float32 or bfloat16, got {dt} and "
                             f"{kv_data.dtype}")
        if kv_data.dtype != dt and not (dt == torch.float32 and kv_data.dtype == torch.bfloat16):
            raise ValueError(f"a {dt} model over a {kv_data.dtype} cache is not supported")
        if d.head_dim > MAX_HEAD_DIM or d.num_heads % d.num_kv_heads:
            raise ValueError(f"head_dim {d.head_dim} / heads {d.num_heads}:{d.num_kv_heads} "
                             "are not supported by the decode kernel")
        shape = (d.num_layers, 2, kv_data.shape[2], kv_data.shape[3], d.num_kv_heads,
                 d.head_dim)
        if kv_data.device.type != "cpu" or tuple(kv_data.shape) != shape or not (
                kv_data.is_contiguous()):
            raise ValueError(f"kv cache must be a contiguous CPU {shape}, got "
                             f"{tuple(kv_data.shape)}")
        h, q, kv, i = (d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim,
                       d.intermediate_size)
        want = {"input_norm": (h,), "qkv": (q + 2 * kv, h), "o": (h, q), "post_norm": (h,),
                "gate_up": (2 * i, h), "down": (h, i)}
        # int8 projections (model.quantization "int8"): the stack reads those and their scales
        int8 = model.quantization == "int8"
        pointers, scales = [], []
        for n, layer in enumerate(model.layers):
            for name, wshape in want.items():
                t, s = getattr(layer, name), None
                if int8 and name in layer.int8:
                    t, s = layer.int8[name].q, layer.int8[name].scale
                elif int8 and len(wshape) == 2:
                    raise ValueError(f"layer {n} {name} has no int8 weight")
                wdt = torch.int8 if s is not None else dt
                if (t.device.type != "cpu" or t.dtype != wdt or tuple(t.shape) != wshape
                        or not t.is_contiguous()):
                    raise ValueError(f"layer {n} {name} must be a contiguous {wdt} {wshape}, "
                                     f"got {t.dtype} {tuple(t.shape)}")
                sshape = (wshape[0], num_groups(wshape[-1]))
                if s is not None and (s.dtype != torch.float32 or tuple(s.shape) != sshape
                                      or not s.is_contiguous() or s.device.type != "cpu"):
                    raise ValueError(f"layer {n} {name}'s scale must be a contiguous float32 "
                                     f"{sshape}")
                pointers.append(t.data_ptr())
                scales.append(None if s is None else s.data_ptr())
        # the LM head as the model's linear reads it: its int8 copy where there is one
        head = model.lm_head_int8
        head_w, head_s = (head.q, head.scale) if head is not None else (model.lm_head, None)
        if (head_w.dtype != (torch.int8 if head_s is not None else dt)
                or tuple(head_w.shape) != (d.vocab_size, h) or not head_w.is_contiguous()
                or (head_s is not None and (not head_s.is_contiguous() or tuple(
                    head_s.shape) != (d.vocab_size, num_groups(h))))):
            raise ValueError(f"the LM head must be a contiguous {dt} or int8 "
                             f"[{d.vocab_size}, {h}]")
        for name, t in (("final_norm", model.final_norm), ("cos", model.cos),
                        ("sin", model.sin)):
            if t.dtype != dt or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {dt}")
        if model.cos.shape != (d.max_position, d.head_dim) or model.sin.shape != model.cos.shape:
            raise ValueError("cos/sin must be [max_position, head_dim]")
        self._lib = load()
        # model and kv_data are held (their memory is what the pointers below point into)
        self._weights = (ctypes.c_void_p * len(pointers))(*pointers)
        self._scales = (ctypes.c_void_p * len(scales))(*scales) if int8 else None
        self._blocks = _block_pointers(model, want)
        self._kv = kv_data
        self._model = model
        # the batched form's packed projections (None in a norm's place), or None
        self._packed = _packed_pointers([
            getattr(layer, name) for layer in model.layers for name in want])
        # the batched form's copy of the head, where it has one (not over int8 weights,
        # which the model's linear reads as int8)
        head_packed = batch_packed(model.lm_head) if self._packed is not None and (
            head_s is None) else None
        head_blocks = _head_blocks(model)
        self._head = DsHead(w=head_w.data_ptr(),
                            scales=None if head_s is None else head_s.data_ptr(),
                            blocks=None if head_blocks is None else head_blocks.data_ptr(),
                            packed=None if head_packed is None else head_packed.data_ptr(),
                            V=d.vocab_size, logits=None)
        # the most rows the GEMV form takes: more over float32 blocks (their GEMV beats the
        # panels there); and the most rows `run` takes
        self.gemv_rows = gguf_blocks.gemv_rows(dt) if self._blocks is not None else GEMV_MAX_ROWS
        self.max_rows = BATCH_MAX_ROWS if self._packed is not None else self.gemv_rows
        self._num_slots = kv_data.shape[2] * kv_data.shape[3]
        self._dims = DsModel(
            L=d.num_layers, H=h, Hq=d.num_heads, Hkv=d.num_kv_heads, D=d.head_dim, I=i,
            max_position=d.max_position, block_size=kv_data.shape[3],
            cache_layer_stride=kv_data.stride(0), eps=d.rms_norm_eps,
            scale=d.head_dim ** -0.5, dt=DTYPE_CODES[dt], kv_dt=DTYPE_CODES[kv_data.dtype])

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """The logits [M, vocab] (the model's dtype) of M decode rows; x [M, H] (the
        embeddings) is the residual stream, updated in place. positions and slots: int64
        [M]; seq_lens: int32 [M] (context after this token); block_tables: int32
        [M, max_blocks] with contiguous rows. The LM head runs in the same C call, except
        for a batch whose head has no packed copy (through the model's linear then)."""
        m = self._model
        t = x.shape[0]
        if (x.dtype != m.dtype or x.dim() != 2 or x.shape[1] != m.dims.hidden_size
                or not x.is_contiguous() or x.device.type != "cpu"):
            raise ValueError(f"x must be a contiguous {m.dtype} [M, {m.dims.hidden_size}], "
                             f"got {x.dtype} {tuple(x.shape)}")
        for name, v, dtype in (("positions", positions, torch.int64),
                               ("slots", slots, torch.int64),
                               ("seq_lens", seq_lens, torch.int32)):
            if v.dtype != dtype or v.shape != (t,) or not v.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {dtype} [{t}], got {v.dtype} "
                                 f"{tuple(v.shape)}")
        if (block_tables.dtype != torch.int32 or block_tables.dim() != 2
                or block_tables.shape[0] != t
                or (block_tables.shape[1] > 1 and block_tables.stride(1) != 1)):
            raise ValueError(f"block_tables must be int32 [{t}, max_blocks] with contiguous "
                             f"rows, got {block_tables.dtype} {tuple(block_tables.shape)}")
        check_tables(seq_lens, block_tables, self._kv[0, 0])
        if t > self.max_rows:
            raise ValueError(f"{t} rows: the decode stack takes at most {self.max_rows}")
        packed = self._packed if t > self.gemv_rows else None
        out = torch.empty_like(x)
        head = self._head
        logits = None
        if packed is None or head.packed:  # the C call computes the logits too
            logits = torch.empty((t, m.dims.vocab_size), dtype=m.dtype)
        head.logits = None if logits is None else logits.data_ptr()
        rc = self._lib.ds_decode_layers(
            ctypes.byref(self._dims), self._weights, self._scales, self._blocks, packed,
            m.final_norm.data_ptr(), None if logits is None else ctypes.byref(head),
            self._kv.data_ptr(), x.data_ptr(), out.data_ptr(), positions.data_ptr(),
            slots.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), m.cos.data_ptr(), m.sin.data_ptr(), self._num_slots, t,
            torch.get_num_threads())
        if rc:
            error, message = _ERRORS[rc]
            raise error(message)
        return logits if logits is not None else m.linear(out, m.lm_head)
