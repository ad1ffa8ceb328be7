"""A model's weights streamed from their GGUF blocks (Q4_1 projections, a Q8_0 LM head;
pdserve/engine/gguf_blocks.py, engine/cpu_kernels/q4_blocks.c): the blocks hold the model's
weights bit for bit (float32, or rounded to bfloat16), the GEMV over them gives the row
GEMV's result bit for bit, the decode stack takes them and decodes the rows' tokens, and a
model they do not match gets none."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from pdserve.engine import gguf_blocks
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_kernels.library import DTYPE_CODES, load
from pdserve.engine.layers.linear import GEMV_MAX_ROWS
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_files import resolve_model
from pdserve.protocol import SamplingParams

FORMATS = [gguf_blocks.Q4_1, gguf_blocks.Q8_0]


def _random_blocks(n: int, k: int, seed: int, ggml_type: int) -> torch.Tensor:
    """n rows of k / 32 blocks with finite float16 scales (and Q4_1's offsets)."""
    g = torch.Generator().manual_seed(seed)
    size = gguf_blocks.FORMATS[ggml_type][0]
    blocks = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8, generator=g)
    scales = 2 if ggml_type == gguf_blocks.Q4_1 else 1
    dm = (torch.randn(n, k // 32, scales, generator=g) * 0.05).to(torch.float16)
    blocks[..., :2 * scales] = dm.view(torch.uint8).reshape(n, k // 32, 2 * scales)
    return blocks.reshape(n, -1)


def _reference(blocks: torch.Tensor, k: int, ggml_type: int) -> torch.Tensor:
    """gguf-py's de-quantization (what transformers loads the model through)."""
    from gguf import GGMLQuantizationType

    out = gguf_dequantize(blocks.numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(-1, k)


@pytest.mark.parametrize("ggml_type", FORMATS)
def test_dequantized_blocks_are_gguf_py_values_bit_for_bit(ggml_type):
    blocks = _random_blocks(64, 576, 1, ggml_type)
    assert torch.equal(gguf_blocks.dequantize(blocks, 576, ggml_type),
                       _reference(blocks, 576, ggml_type))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ggml_type", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 8, 12])
def test_gemv_over_blocks_is_the_product_of_the_models_weights(rows, ggml_type, dtype):
    # 201 columns: float32 passes of 5-8 rows take the block rows in pairs, and the last
    # one alone; 12 rows are a pass of 8 (pairs) and one of 4 (one block row at a time)
    n, k = 201, 1536
    blocks = _random_blocks(n, k, rows, ggml_type)
    w = _reference(blocks, k, ggml_type).to(dtype)  # what a model of that dtype holds
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9)).to(dtype)
    y = torch.empty(rows, n, dtype=dtype)
    load().blocks_linear(x.data_ptr(), blocks.data_ptr(), gguf_blocks.FORMATS[ggml_type][1],
                         y.data_ptr(), rows, n, k, DTYPE_CODES[dtype], torch.get_num_threads())
    ref = x.double() @ w.double().T
    # float32 sums of 1536 exact products, in another order than float64's; a bfloat16
    # result is rounded once more
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ggml_type", FORMATS)
def test_long_odd_rows_give_the_row_gemv_bit_for_bit(ggml_type, dtype):
    # 301 blocks a row: an odd count leaves a tail past every group of U accumulators
    # (q4_blocks.c and gemv.c must add those the same way)
    if not load().blocks_fast(DTYPE_CODES[dtype]):
        pytest.skip(f"no vector form of the blocks' GEMV for {dtype} in this build")
    blocks = _random_blocks(9, 32 * 301, 5, ggml_type)
    w = gguf_blocks.dequantize(blocks, 32 * 301, ggml_type).to(dtype)
    _assert_blocks_give_the_row_gemv(w, blocks, gguf_blocks.FORMATS[ggml_type][1])


def _assert_blocks_give_the_row_gemv(w: torch.Tensor, rows: torch.Tensor, fmt: int) -> None:
    """The blocks' GEMV over `rows` (format code fmt) equals the row GEMV over w, bit for
    bit, at 1-4 rows of x in w's dtype."""
    lib, n, k, dt = load(), w.shape[0], w.shape[1], DTYPE_CODES[w.dtype]
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(w.dtype)
        ours, gemv = torch.empty(m, n, dtype=w.dtype), torch.empty(m, n, dtype=w.dtype)
        lib.blocks_linear(x.data_ptr(), rows.data_ptr(), fmt, ours.data_ptr(), m, n, k, dt,
                          torch.get_num_threads())
        lib.gv_linear(x.data_ptr(), k, w.data_ptr(), None, gemv.data_ptr(), n, m, n, k, dt,
                      torch.get_num_threads())
        assert torch.equal(ours, gemv), (tuple(w.shape), m)


def test_row_order_finds_moved_rows_and_refuses_a_changed_one():
    w = torch.randn(96, 64)
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(3))
    order = gguf_blocks._row_order(w, w[perm].clone())
    assert order is not None and torch.equal(w[perm][order], w)
    changed = w.clone()
    changed[5, 40] = torch.nextafter(changed[5, 40], torch.tensor(1e9))  # one ulp
    assert gguf_blocks._row_order(changed, w[perm].clone()) is None


@pytest.fixture(scope="module")
def default_gguf() -> str:
    src = resolve_model("smollm2-135m")
    return os.path.join(src.directory, src.gguf_file)


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model="smollm2-135m", kv_cache_memory="64MiB",
                                  show_progress=False, enable_prefix_caching=False, **kw))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_streams_its_blocks_and_decodes_its_rows_tokens(default_gguf, dtype):
    blocked = _engine(dtype=dtype)
    blocks = blocked.model.gguf_blocks
    if not load().blocks_fast(DTYPE_CODES[blocked.model.dtype]):
        assert blocks is None  # slower than the rows on this build: not taken
        return
    assert blocks is not None and len(blocks.layers) == blocked.dims.num_layers
    for layer, lw in zip(blocks.layers, blocked.model.layers):
        for name, rows in layer.items():
            w = getattr(lw, name)
            assert torch.equal(gguf_blocks.dequantize(rows, w.shape[1]).to(w.dtype), w), name
    head = blocked.model.lm_head
    assert blocks.head is not None
    assert torch.equal(gguf_blocks.dequantize(blocks.head, head.shape[1], gguf_blocks.Q8_0)
                       .to(head.dtype), head)
    plain = _engine(dtype=dtype, gguf_blocks=False)
    assert plain.model.gguf_blocks is None
    prompts = [plain.tokenizer.encode(p) for p in ("The capital of France is", "def fib(n):",
                                                    "Once upon a time")]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for n in (1, 3):  # one row, and the GEMV's batch
        ours = [o.token_ids for o in blocked.generate(prompts[:n], params)]
        ref = [o.token_ids for o in plain.generate(prompts[:n], params)]
        assert ours == ref
    stack = blocked.model._decode_stack
    # the stack read the blocks, the head's too
    assert stack is not None and stack[1]._blocks is not None and stack[1]._head.blocks
    # float32: the blocks' GEMV takes batches up to 8 rows, where the rows' GEMV stops at 4
    # (their packed panels take over); a bfloat16 model's panels win from 5 rows
    assert stack[1].gemv_rows == (gguf_blocks.F32_GEMV_MAX_ROWS if dtype == "float32"
                                  else GEMV_MAX_ROWS)
    assert plain.model._decode_stack[1].gemv_rows == GEMV_MAX_ROWS


def test_float32_batches_past_the_row_gemv_decode_over_the_blocks(default_gguf):
    """Six rows: the blocks' GEMV (pairs of block rows) against the model without blocks
    (the packed panels over its rows): other sums of the same products, the same greedy
    tokens on these prompts."""
    blocked, plain = _engine(dtype="float32"), _engine(dtype="float32", gguf_blocks=False)
    if blocked.model.gguf_blocks is None:
        pytest.skip("this build streams no blocks for float32")
    prompts = [plain.tokenizer.encode(p) for p in (
        "The capital of France is", "def fib(n):", "Once upon a time", "List three colors:",
        "The sum of 2 and 3 is", "import numpy as")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in blocked.generate(prompts, params)]
    assert ours == [o.token_ids for o in plain.generate(prompts, params)]
    assert blocked.model._decode_stack[1].gemv_rows == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocks_give_the_row_gemv_bit_for_bit(dtype):
    if not load().blocks_fast(DTYPE_CODES[dtype]):
        pytest.skip(f"no vector form of the blocks' GEMV for {dtype} in this build")
    engine = _engine(dtype=str(dtype).removeprefix("torch."))
    blocks, model = engine.model.gguf_blocks, engine.model
    cases = [(getattr(model.layers[3], n), blocks.layers[3][n], 1) for n in ("qkv", "down")]
    cases.append((model.lm_head, blocks.head, 2))
    for w, rows, fmt in cases:
        _assert_blocks_give_the_row_gemv(w, rows, fmt)


def test_no_blocks_for_int8_or_weights_they_do_not_hold(default_gguf):
    assert _engine(quantization="int8").model.gguf_blocks is None
    engine = _engine(gguf_blocks=False)
    layer = engine.model.layers[2]
    layer.down = layer.down.clone()
    layer.down[0, 0] += 1.0  # no longer the GGUF's value
    assert gguf_blocks.model_blocks(default_gguf, engine.model) is None
