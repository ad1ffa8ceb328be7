"""The C decode stack (engine/cpu_kernels/decode_stack.c): a CPU decode step's layers in one
call must give the model's layer loop's tokens exactly (same kernels, same order), take only
the steps it is meant for, and refuse bad rows before writing anything."""

from __future__ import annotations

import pytest
import torch

import pdserve.engine.llama as llama
from pdserve.engine.cpu_kernels import bf16_panels
from pdserve.engine.cpu_kernels.amx_linear import amx_available
from pdserve.engine.cpu_kernels.decode_stack import CpuDecodeStack
from pdserve.engine.cpu_kernels.f32_panels import panels_available
from pdserve.engine.cpu_kernels.library import load
from pdserve.engine.layers.linear import BATCH_MAX_ROWS, GEMV_MAX_ROWS
from pdserve.protocol import SamplingParams
from tests.conftest import tiny_engine

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,",
           "Hello", "A B C D E F G"]


def _generate(engine, prompts, use_stack: bool, monkeypatch, **params):
    calls = []
    real = llama.LlamaModel._stack_for

    def spy(self, *a, **k):
        stack = real(self, *a, **k) if use_stack else None
        calls.append(stack is not None)
        return stack

    monkeypatch.setattr(llama.LlamaModel, "_stack_for", spy)
    ids = [engine.tokenizer.encode(p) for p in prompts]
    outs = engine.generate(ids, SamplingParams(max_tokens=24, ignore_eos=True, **params))
    monkeypatch.setattr(llama.LlamaModel, "_stack_for", real)
    return [o.token_ids for o in outs], calls


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", None), ("bfloat16", None),
                                            ("float32", "bfloat16")])
def test_same_tokens_as_the_layer_loop(tiny_model_dir, dtype, kv_dtype, monkeypatch):
    engine = tiny_engine(tiny_model_dir, dtype=dtype, kv_cache_dtype=kv_dtype)
    assert len(PROMPTS) > GEMV_MAX_ROWS
    for n in (1, 3, len(PROMPTS)):
        loop, _ = _generate(engine, PROMPTS[:n], False, monkeypatch, temperature=0.0)
        stack, used = _generate(engine, PROMPTS[:n], True, monkeypatch, temperature=0.0)
        assert stack == loop
        # every row decodes to the same length: a batch past GEMV_MAX_ROWS never shrinks;
        # it is the batched form's where the build and CPU have its kernel
        assert any(used) == (n <= GEMV_MAX_ROWS or _batched_kernel(dtype))
    seeded_loop, _ = _generate(engine, PROMPTS[:2], False, monkeypatch, temperature=0.8, seed=7)
    seeded_stack, _ = _generate(engine, PROMPTS[:2], True, monkeypatch, temperature=0.8, seed=7)
    assert seeded_stack == seeded_loop


def _batched_kernel(dtype: str) -> bool:
    """Whether this build and CPU run the stack's batched form for a model of dtype."""
    if dtype == "bfloat16":
        return amx_available() or bf16_panels.panels_available()
    return panels_available()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_form_gives_the_loops_tokens(tiny_model_dir, monkeypatch, dtype):
    """Batches past GEMV_MAX_ROWS: rows around the tiles' 16 and 32 (the buffers' zeroed
    padding) and the panels' 12-row blocks, the most the stack takes, and one past it (the
    loop's)."""
    if not _batched_kernel(dtype):
        pytest.skip(f"no batched kernel for {dtype} here")
    engine = tiny_engine(tiny_model_dir, dtype=dtype, enable_prefix_caching=False,
                         max_num_batched_tokens=2048)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(BATCH_MAX_ROWS + 1)]
    for n in (5, 17, 33, BATCH_MAX_ROWS, BATCH_MAX_ROWS + 1):
        loop, _ = _generate(engine, prompts[:n], False, monkeypatch, temperature=0.0)
        seen = []
        real = CpuDecodeStack.run

        def spy(self, x, *a, real=real, seen=seen):
            seen.append(x.shape[0])
            return real(self, x, *a)

        monkeypatch.setattr(CpuDecodeStack, "run", spy)
        stack, _ = _generate(engine, prompts[:n], True, monkeypatch, temperature=0.0)
        monkeypatch.setattr(CpuDecodeStack, "run", real)
        assert stack == loop, n
        assert (n in seen) == (n <= BATCH_MAX_ROWS), (n, seen)


def test_taken_only_for_small_pure_decode_steps(tiny_model_dir, monkeypatch):
    engine = tiny_engine(tiny_model_dir)
    seen = []
    real = CpuDecodeStack.run

    def spy(self, x, *a):
        seen.append(x.shape[0])
        return real(self, x, *a)

    monkeypatch.setattr(CpuDecodeStack, "run", spy)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    engine.trace = []
    engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))
    # the steps with a prompt's chunk (one prompt a step, a decode beside the later ones) do
    # not take it; every pure decode step does, with its rows
    pure = [len(t.scheduled) for t in engine.trace if all(n == 1 for _, n in t.scheduled)]
    assert len(pure) == len(engine.trace) - 3
    assert seen == pure and max(pure) == 3


def _stack_and_step(engine):
    model, kv = engine.model, engine.kv_cache
    stack = CpuDecodeStack(model, kv.data)
    d = model.dims
    x = model.embed[torch.tensor([5, 6])].clone()
    step = dict(positions=torch.tensor([3, 4]), slots=torch.tensor([16, 33]),
                seq_lens=torch.tensor([4, 5], dtype=torch.int32),
                block_tables=torch.tensor([[1, 0], [2, 0]], dtype=torch.int32))
    return stack, x, step, d, kv


def test_bad_rows_are_refused_before_any_write(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    stack, x, step, d, kv = _stack_and_step(engine)
    before = kv.data.clone()
    num_slots = kv.data.shape[2] * kv.data.shape[3]
    for field, bad, match in (("slots", torch.tensor([16, num_slots]), "slot is outside"),
                              ("slots", torch.tensor([-1, 3]), "slot is outside"),
                              ("positions", torch.tensor([3, d.max_position]), "position"),
                              ("seq_lens", torch.tensor([4, 0], dtype=torch.int32), "seq_lens"),
                              ("block_tables", torch.tensor([[1, 0], [kv.data.shape[2], 0]],
                                                            dtype=torch.int32), "block id"),

                              ("positions", torch.tensor([3, 4], dtype=torch.int32), "int64")):
        args = dict(step, **{field: bad})
        with pytest.raises(ValueError, match=match):
            stack.run(x.clone(), **args)
    # slots, tables and positions are checked before the layers: nothing was written
    assert torch.equal(kv.data, before)
    out = stack.run(x.clone(), **step)  # the logits
    assert out.shape == (x.shape[0], d.vocab_size) and torch.isfinite(out).all()
    assert not torch.equal(kv.data, before)  # the good step stored its K/V


def test_layouts_it_does_not_take_are_refused(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    model, kv = engine.model, engine.kv_cache
    with pytest.raises(ValueError, match="kv cache must be"):
        CpuDecodeStack(model, kv.data[:, :, :4].clone()[:1])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        CpuDecodeStack(model, kv.data.half())


def _wide_model(dtype: torch.dtype, rows: int, blocks_per_row: int = 8):
    """Two random layers wide enough that every thread's share of a projection is many
    runs (decode_stack.c's work sharing), a vocabulary the batched kernels pack (the LM
    head in the C call for both forms), and a cache of blocks_per_row 16-token blocks per
    row (positions up to as many tokens)."""
    from transformers import LlamaConfig

    h, i, heads, kv_heads, hd = 256, 1024, 4, 2, 64
    dims = llama.LlamaDims(num_layers=2, hidden_size=h, num_heads=heads,
                           num_kv_heads=kv_heads, head_dim=hd, intermediate_size=i,
                           vocab_size=320, rms_norm_eps=1e-5,
                           max_position=16 * blocks_per_row)
    gen = torch.Generator().manual_seed(3)
    state = {"model.embed_tokens.weight": torch.randn(320, h, generator=gen),
             "lm_head.weight": torch.randn(320, h, generator=gen),
             "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen)}
    for n in range(2):
        p = f"model.layers.{n}."
        for name, shape in (("self_attn.q_proj", (heads * hd, h)),
                            ("self_attn.k_proj", (kv_heads * hd, h)),
                            ("self_attn.v_proj", (kv_heads * hd, h)),
                            ("self_attn.o_proj", (h, heads * hd)), ("mlp.gate_proj", (i, h)),
                            ("mlp.up_proj", (i, h)), ("mlp.down_proj", (h, i))):
            state[p + name + ".weight"] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
        for name in ("input_layernorm", "post_attention_layernorm"):
            state[p + name + ".weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    cfg = LlamaConfig(vocab_size=320, hidden_size=h, intermediate_size=i, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd,
                      max_position_embeddings=16 * blocks_per_row, tie_word_embeddings=False)
    model = llama.LlamaModel(dims, state, cfg, dtype, torch.device("cpu"))
    kv = torch.randn(2, 2, blocks_per_row * rows, 16, kv_heads, hd, generator=gen).to(dtype)
    return model, kv


@pytest.mark.parametrize("dtype,rows,long_first",
                         [(torch.float32, 1, False), (torch.float32, 1, True),
                          (torch.float32, GEMV_MAX_ROWS, False), (torch.float32, 37, False),
                          (torch.float32, 37, True), (torch.bfloat16, 2, False),
                          (torch.bfloat16, 37, False), (torch.bfloat16, 37, True)])
def test_the_result_does_not_depend_on_the_team(dtype, rows, long_first):
    """Which thread computes which columns and rows depends on which is free first; the
    result must not. Teams of 1, 2, 3 and 7 threads (7 on this machine's cores: threads
    preempted mid-step, their siblings taking over their shares) give the same bits, out
    and cache. 37 rows take the batched form where the build and CPU have its kernel.
    long_first: the first sequence at 601 tokens, long enough that attention splits it in
    token ranges and merges them (the GEMV form alone, the batched form among short ones)."""
    if rows > GEMV_MAX_ROWS and not _batched_kernel(str(dtype).removeprefix("torch.")):
        pytest.skip(f"no batched kernel for {dtype} here")
    per_row = 40 if long_first else 8
    model, kv = _wide_model(dtype, rows, per_row)
    stack = CpuDecodeStack(model, kv)
    assert rows <= GEMV_MAX_ROWS or stack._head.packed  # the batched form's head in C
    pos = torch.tensor([(5 * r) % 100 + 3 for r in range(rows)])
    if long_first:  # the rest short: 601 tokens are more than the 512 a range may hold
        pos = torch.tensor([600] + [r % 5 + 3 for r in range(1, rows)])
        lens = (pos + 1).int()
        assert load().pd_splits(lens.data_ptr(), rows, 16)
    step = dict(positions=pos, slots=torch.arange(rows) * 16 * per_row + pos,
                seq_lens=(pos + 1).to(torch.int32),
                block_tables=(torch.arange(rows, dtype=torch.int32)[:, None] * per_row
                              + torch.arange(per_row, dtype=torch.int32)))
    x = model.embed[torch.arange(rows) * 7 % 300].clone()
    cache = kv.clone()
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3, 7):
            torch.set_num_threads(n)
            kv.copy_(cache)
            xn = x.clone()
            results.append((n, stack.run(xn, **step), xn, kv.clone()))
    finally:
        torch.set_num_threads(threads)
    _, out, residual, stored = results[0]
    assert torch.isfinite(out.float()).all() and not torch.equal(stored, cache)
    for n, o, r, s in results[1:]:
        assert torch.equal(o, out) and torch.equal(r, residual) and torch.equal(s, stored), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_thread_that_loses_its_core_is_not_waited_for(dtype):
    """The GEMV form: team thread 1 sleeps 3 ms after claiming each projection run and
    attention item, as a thread preempted while holding it would. Thread 0 computes what
    thread 1 holds itself instead of waiting, and the result is one thread's, bit for bit:
    logits, residual and cache."""

    lib = load()
    model, kv = _wide_model(dtype, GEMV_MAX_ROWS)
    stack = CpuDecodeStack(model, kv)
    pos = torch.tensor([3, 40, 77, 101])
    step = dict(positions=pos, slots=torch.arange(4) * 128 + pos,
                seq_lens=(pos + 1).to(torch.int32),
                block_tables=(torch.arange(4, dtype=torch.int32)[:, None] * 8
                              + torch.arange(8, dtype=torch.int32)))
    x = model.embed[torch.tensor([5, 9, 13, 200])].clone()
    cache = kv.clone()
    threads = torch.get_num_threads()
    results = []
    try:
        for n, stall in ((1, -1), (2, 1)):
            torch.set_num_threads(n)
            lib.ds_test_stall(stall, 3000)
            kv.copy_(cache)
            xn = x.clone()
            before = lib.ds_redone()
            results.append((stack.run(xn, **step), xn, kv.clone(), lib.ds_redone() - before))
    finally:
        lib.ds_test_stall(-1, 0)
        torch.set_num_threads(threads)
    (logits, residual, stored, none), (o, r, s, redone) = results
    assert none == 0 and redone > 0
    assert torch.equal(o, logits) and torch.equal(r, residual) and torch.equal(s, stored)
    assert not torch.equal(stored, cache) and torch.isfinite(logits.float()).all()
