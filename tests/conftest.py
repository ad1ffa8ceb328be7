"""Shared fixtures: a tiny random-weight Llama (with the SmolLM2 tokenizer) and the real
SmolLM2-135M, each loaded once per session."""

from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton fixes interpreter mode when it is first imported (its own library functions are
# decorated then), and any test may import it through the engine's backend registry: set it
# before anything does. scripts/gpu_check.py runs these tests with it set to 0 on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_SEED = 1234

# The end-to-end tier: files whose tests start real servers (gRPC, HTTP on 127.0.0.1) or
# pdserve processes (gateway, workers, clusters, the CLI and scripts). Everything else is
# the unit tier, in-process and server-free: `make test-unit` runs it alone.
E2E_FILES = frozenset({
    "test_bench_loadgen.py", "test_burst.py", "test_chaos.py", "test_cli_generate.py",
    "test_cluster.py",
    "test_compile_check.py", "test_deploy.py", "test_disagg.py", "test_gateway_admission.py",
    "test_gateway_cluster.py", "test_gateway_e2e.py", "test_gateway_gguf.py",
    "test_gpu_check.py", "test_kv_connector.py", "test_kv_shm.py", "test_kvtransfer.py",
    "test_liveness.py", "test_multihost.py", "test_planner_signal.py", "test_role_switch.py",
    "test_trust.py", "test_worker_drop.py",
})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.name in E2E_FILES:
            item.add_marker(pytest.mark.e2e)


def pytest_sessionstart(session) -> None:
    # a renamed or deleted file must leave the list, not silently move tests between tiers
    here = os.path.dirname(os.path.abspath(__file__))
    missing = sorted(f for f in E2E_FILES if not os.path.exists(os.path.join(here, f)))
    if missing:
        raise pytest.UsageError(f"tests/conftest.py E2E_FILES names missing files: {missing}")


def make_tiny_model(path: str, vocab_size: int = 49152, num_kv_heads: int = 2) -> str:
    """A 2-layer GQA Llama with random weights and the real SmolLM2 tokenizer, saved as a
    Hugging Face directory (safetensors) — the same loading path as any local model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
    tok = load_smollm2_tokenizer()
    if tok is not None:
        tok.save_pretrained(path)
    return path


@functools.cache
def load_smollm2_tokenizer():
    """SmolLM2-135M's tokenizer, loaded once per process from the GGUF's export (plain
    Hugging Face files, made at install or by a child process on first use): what the
    gateway loads, held to the GGUF's own tokenizer token for token by test_gateway_gguf
    and saving byte-identical files, without parsing the GGUF (seconds) again and again."""
    from transformers import AutoTokenizer

    from pdserve.engine.model_files import gguf_export, load_tokenizer, resolve_model

    source = resolve_model("smollm2-135m")
    if not source.gguf_file:
        return load_tokenizer(source)
    return AutoTokenizer.from_pretrained(str(gguf_export(source)))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """load_smollm2_tokenizer()'s tokenizer, shared: tests must not modify it."""
    return load_smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


def hf_greedy(model_dir_or_source, prompts: list[list[int]], max_new_tokens: int,
              gguf_file: str | None = None) -> list[list[int]]:
    """The oracle: transformers `generate`, greedy, one prompt at a time (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    hf = AutoModelForCausalLM.from_pretrained(model_dir_or_source, dtype=torch.float32, **kwargs)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            g = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                            min_new_tokens=max_new_tokens, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def hf_top5(model_dir_or_source, ids: list[int], gguf_file: str | None = None) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    hf = AutoModelForCausalLM.from_pretrained(model_dir_or_source, dtype=torch.float32, **kwargs)
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].topk(5).indices.tolist()


def assert_parity(ours: list[int], ref: list[int], top5_ours=None, top5_ref=None) -> int:
    """ARCHITECTURE.md's rule: equal token for token; at the first difference both tokens
    must be in each other's top-5 (checked by the caller's callbacks), and the comparison
    stops there. Returns the number of tokens compared."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert top5_ours is not None and top5_ref is not None, (
                f"first difference at token {i}: ours {a} vs reference {b}")
            t_ours, t_ref = top5_ours(i), top5_ref(i)
            assert b in t_ours and a in t_ref, (
                f"token {i}: ours {a} vs reference {b} are not in each other's top-5")
            return i
    assert len(ours) == len(ref), f"lengths differ: {len(ours)} vs {len(ref)}"
    return len(ours)


def assert_pool_clean(engine) -> None:
    """Every block free or reclaimable; nothing held by a sequence."""
    s = engine.pool.stats()
    assert s.free == s.total, f"{s.total - s.free} KV blocks still held: {s}"
    assert not engine.seqs, f"sequences left behind: {list(engine.seqs)}"


@pytest.fixture(scope="session")
def smollm2_hf():
    """The real SmolLM2-135M through transformers (the oracle), loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.engine.model_files import resolve_model

    src = resolve_model("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file,
                                                dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_engine():
    """The real SmolLM2-135M in our engine, loaded once (tests must leave the pool clean)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model="smollm2-135m", kv_cache_memory="256MiB",
                                  max_num_batched_tokens=512, show_progress=False))


def tiny_engine(model_dir: str, **kw):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("max_num_batched_tokens", 128)
    return LLMEngine(EngineConfig(model=model_dir, show_progress=False, **kw))
