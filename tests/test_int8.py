"""Weight-only int8 (engine/layers/int8.py, `pdserve::gemv_linear_int8`, the decode stack
over int8 projections, `--quantization int8`): the quantization's error bound, the kernel
against the de-quantized weight in float64, and an int8 engine whose every path computes
with the same weights.

Tolerances as in test_gemv.py: float32 differs from the reference only in summation order;
a bfloat16 result is a float32 sum rounded once (2^-8 relative)."""

from __future__ import annotations

import argparse

import pytest
import torch

import pdserve.engine.cpu_kernels.gemv as gemv
import pdserve.engine.llama as llama
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_kernels.decode_stack import CpuDecodeStack
from pdserve.engine.cpu_kernels.gemv import gemv_linear_int8
from pdserve.engine.layers.int8 import (
    GROUP,
    QMAX,
    int8_linear_reference,
    num_groups,
    quantize_activations,
    quantize_int8,
)
from pdserve.engine_args import add_engine_args, engine_argv, engine_config_from_args
from pdserve.protocol import SamplingParams
from tests.conftest import tiny_engine

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2 ** -8)}


@pytest.mark.parametrize("k", [GROUP * 9, 100, 17])  # whole groups, a partial last group
def test_quantization_error_is_half_a_step(k):
    w = torch.randn(40, k, generator=torch.Generator().manual_seed(k)) * 0.05
    w[3] = 0.0  # an all-zero row: scale 1, q 0
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.q.shape == w.shape and qw.q.is_contiguous()
    assert qw.scale.dtype == torch.float32 and qw.scale.shape == (40, num_groups(k))
    assert int(qw.q.abs().max()) == QMAX and not qw.q[3].any()
    assert torch.equal(qw.scale[3], torch.ones(num_groups(k)))
    per_weight = qw.scale.repeat_interleave(GROUP, dim=1)[:, :k]
    err = (qw.dequantize(torch.float32) - w).abs()
    assert (err <= per_weight / 2 + 1e-7).all()
    # each group's largest |w| is represented exactly at +-127 steps
    assert torch.allclose(qw.scale[0, 0] * QMAX, w[0, :GROUP].abs().max())
    assert qw.nbytes == 40 * k + 40 * num_groups(k) * 4


def test_quantize_refuses_what_is_not_a_float_matrix():
    with pytest.raises(ValueError, match=r"float \[N, K\]"):
        quantize_int8(torch.randn(4))
    with pytest.raises(ValueError, match=r"float \[N, K\]"):
        quantize_int8(torch.ones(4, 4, dtype=torch.int32))


def test_activations_are_quantized_per_group():
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(2)) * 4
    x[1, 64:] = 0.0  # an all-zero group: scale 1, q 0
    xq, sx = quantize_activations(x)
    assert xq.shape == (3, 2 * GROUP) and sx.shape == (3, 2) and not xq[:, 100:].any()
    assert not xq[1, 64:].any() and float(sx[1, 1]) == 1.0
    err = (xq[:, :100].float() * sx.repeat_interleave(GROUP, dim=1)[:, :100] - x).abs()
    assert (err <= sx.repeat_interleave(GROUP, dim=1)[:, :100] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 9])  # 9: past a pass of 8 rows of x
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 64), (100, 33), (17, 5), (3, 7000)])
def test_gemv_int8_matches_the_reference(dtype, m, k, n):
    """The kernel against its arithmetic in float64 (int8_linear_reference); and that
    arithmetic stays within int8's error of the de-quantized weight times x."""
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    qw = quantize_int8(torch.randn(n, k, generator=gen))
    got = gemv_linear_int8(x, qw.q, qw.scale)
    assert got.shape == (m, n) and got.dtype == dtype and got.is_contiguous()
    want = int8_linear_reference(x, qw)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    full = x.double() @ qw.dequantize(torch.float64).T
    # x's rounding: half a step (amax / 254) per element, against |w| <= amax(w)
    bound = (x.double().abs().max() / 254) * qw.dequantize(torch.float64).abs().sum(dim=1)
    assert ((want - full).abs() <= bound[None, :] + 1e-9).all()


def test_gemv_int8_threads_and_strides():
    qw = quantize_int8(torch.randn(5000, 576))
    wide = torch.randn(3, 1000)
    x = wide[:, 100:676]  # a column slice: row stride 1000
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemv_linear_int8(x, qw.q, qw.scale)
        torch.set_num_threads(max(2, threads))
        many = gemv_linear_int8(x, qw.q, qw.scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert gemv_linear_int8(torch.randn(0, 576), qw.q, qw.scale).shape == (0, 5000)


def _bad_int8_calls():
    x, qw = torch.randn(2, 100), quantize_int8(torch.randn(4, 100))
    yield (lambda: gemv_linear_int8(x.half(), qw.q, qw.scale)), "float32 or bfloat16"
    yield (lambda: gemv_linear_int8(x, qw.q.float(), qw.scale)), "q int8"
    yield (lambda: gemv_linear_int8(x, qw.q, qw.scale.double())), "scale float32"
    yield (lambda: gemv_linear_int8(x, qw.q, qw.scale[:, :1])), r"ceil\(K / 64\)"
    yield (lambda: gemv_linear_int8(torch.randn(2, 99), qw.q, qw.scale)), r"\[M, K\]"
    yield (lambda: gemv_linear_int8(x, qw.q.t().contiguous().t(), qw.scale)), "contiguous"
    yield (lambda: gemv_linear_int8(torch.randn(100, 2).t(), qw.q, qw.scale)), "last dim"


@pytest.mark.parametrize("call,match", list(_bad_int8_calls()))
def test_gemv_int8_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_int8_engine_computes_with_the_dequantized_weights(tiny_model_dir):
    plain = tiny_engine(tiny_model_dir)
    int8 = tiny_engine(tiny_model_dir, quantization="int8")
    for lp, lq in zip(plain.model.layers, int8.model.layers):
        assert set(lq.int8) == set(llama.PROJECTIONS) and not lp.int8
        for name in llama.PROJECTIONS:
            qw = lq.int8[name]
            # the model-dtype weight every other path reads is the int8 weight's value,
            # quantized from the float32 weight as loaded
            assert torch.equal(getattr(lq, name), qw.dequantize(torch.float32))
            assert torch.equal(qw.q, quantize_int8(getattr(lp, name)).q)
    head = int8.model.lm_head_int8
    assert head is not None and torch.equal(int8.model.lm_head, head.dequantize(torch.float32))
    # the tiny model's head is its own tensor: the embedding stays as loaded
    assert torch.equal(int8.model.embed, plain.model.embed)
    assert not torch.equal(int8.model.lm_head, plain.model.lm_head)


def test_a_tied_embedding_is_quantized_with_the_head():
    from transformers import LlamaConfig

    dims = llama.LlamaDims(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                           head_dim=16, intermediate_size=128, vocab_size=300,
                           rms_norm_eps=1e-5, max_position=64)
    gen = torch.Generator().manual_seed(1)
    p = "model.layers.0."
    state = {"model.embed_tokens.weight": torch.randn(300, 64, generator=gen),
             "model.norm.weight": torch.ones(64), p + "input_layernorm.weight": torch.ones(64),
             p + "post_attention_layernorm.weight": torch.ones(64)}
    for name, shape in (("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)),
                        ("self_attn.v_proj", (32, 64)), ("self_attn.o_proj", (64, 64)),
                        ("mlp.gate_proj", (128, 64)), ("mlp.up_proj", (128, 64)),
                        ("mlp.down_proj", (64, 128))):
        state[p + name + ".weight"] = torch.randn(*shape, generator=gen)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
    model = llama.LlamaModel(dims, state, cfg, torch.float32, torch.device("cpu"),
                             quantization="int8")
    assert model.embed is model.lm_head  # one tensor, as in the unquantized tied model
    want = quantize_int8(state["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head_int8.q, want.q)
    assert torch.equal(model.embed, want.dequantize(torch.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_decode_stack_reads_the_int8_weights(tiny_model_dir, dtype):
    engine = tiny_engine(tiny_model_dir, dtype=dtype, quantization="int8")
    model, kv = engine.model, engine.kv_cache
    stack = CpuDecodeStack(model, kv.data)
    x = model.embed[torch.tensor([5, 6])].clone()
    step = dict(positions=torch.tensor([3, 4]), slots=torch.tensor([16, 33]),
                seq_lens=torch.tensor([4, 5], dtype=torch.int32),
                block_tables=torch.tensor([[1, 0], [2, 0]], dtype=torch.int32))
    first = stack.run(x.clone(), **step)
    layer = model.layers[0]
    saved = layer.gate_up.clone()
    layer.gate_up.zero_()  # the model-dtype copy: not what the stack reads
    assert torch.equal(stack.run(x.clone(), **step), first)
    layer.gate_up.copy_(saved)
    saved_q = layer.int8["gate_up"].q.clone()
    layer.int8["gate_up"].q.zero_()
    assert not torch.equal(stack.run(x.clone(), **step), first)
    layer.int8["gate_up"].q.copy_(saved_q)
    assert torch.equal(stack.run(x.clone(), **step), first)


def test_int8_stack_gives_the_layer_loops_tokens(tiny_model_dir, monkeypatch):
    """float32: for a few rows the loop and the stack both run the int8 kernels (the loop
    through the model's int8 linear); they differ only in summation order. A prefill or a
    batch past GEMV_MAX_ROWS computes on the de-quantized weights."""
    engine = tiny_engine(tiny_model_dir, quantization="int8")
    engine.scheduler.serial_queue = -1  # both prompts in one step: two rows decode together
    ids = [engine.tokenizer.encode(p) for p in ("The capital of France is", "def fib(n):")]
    real = llama.LlamaModel._stack_for
    rows = []
    real_kernel = gemv.gemv_linear_int8
    monkeypatch.setattr(gemv, "gemv_linear_int8",
                        lambda x, q, s: rows.append((x.shape[0], q.shape)) or real_kernel(x, q, s))
    outs = {}
    for use_stack in (False, True):
        used = []

        def spy(self, *a, use=use_stack, used=used, **k):
            stack = real(self, *a, **k) if use else None
            used.append(stack is not None)
            return stack

        monkeypatch.setattr(llama.LlamaModel, "_stack_for", spy)
        rows.clear()
        res = engine.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True,
                                                  temperature=0.0))
        outs[use_stack] = [o.token_ids for o in res]
        assert any(used) == use_stack
        head = engine.model.lm_head_int8.q.shape
        # the stack: only its logits come through the op; the loop: every projection too
        assert rows and all(m == 2 for m, _ in rows)
        assert {s for _, s in rows} == ({head} if use_stack else
                                        {head} | {lw.int8[n].q.shape
                                                  for lw in engine.model.layers
                                                  for n in llama.PROJECTIONS})
    assert outs[True] == outs[False]


def test_quantization_flag_and_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["--quantization", "int8", "--model", "m"])
    assert engine_config_from_args(a).quantization == "int8"
    assert engine_argv(a) == ["--quantization", "int8"]  # the workers get it
    plain = p.parse_args(["--model", "m"])
    assert engine_config_from_args(plain).quantization is None and engine_argv(plain) == []
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "int4"])
    with pytest.raises(ValueError, match="int8 or none"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="int8", device="cuda")
