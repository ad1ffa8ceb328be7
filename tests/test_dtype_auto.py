"""--dtype auto: bfloat16 where the CPU has native bfloat16 math, float32 elsewhere,
resolved once in EngineConfig (what the engine, the KV layout and the logs then see)."""

from __future__ import annotations

import logging

from conftest import tiny_engine

from pdserve.engine.config import EngineConfig, auto_dtype, cpu_flags, slow_bf16_warning
from pdserve.protocol import SamplingParams


def test_auto_reads_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "absent")) == frozenset()
    assert auto_dtype("cpu", frozenset({"avx512f", "avx512_bf16"}))[0] == "bfloat16"
    assert auto_dtype("cpu", frozenset({"amx_tile", "amx_bf16"}))[0] == "bfloat16"
    dtype, why = auto_dtype("cpu", frozenset({"avx2", "avx512f"}), panels=False)
    assert dtype == "float32" and "avx512_bf16" in why and "--dtype bfloat16" not in why
    # a build with the AVX2 panels: float32 still, and the log says what bfloat16 would give
    dtype, why = auto_dtype("cpu", frozenset({"avx2", "fma"}), panels=True)
    assert dtype == "float32" and "--dtype bfloat16 would run on" in why


def test_auto_resolves_once_and_says_so(tiny_model_dir, caplog):
    expected = auto_dtype("cpu")[0]
    with caplog.at_level(logging.INFO, logger="pdserve.engine"):
        cfg = EngineConfig(model=tiny_model_dir, dtype="auto")
    assert cfg.dtype == expected and cfg.cache_dtype == expected
    assert f"dtype auto: {expected}" in caplog.text
    eng = tiny_engine(tiny_model_dir, dtype="auto", num_threads=1)
    assert eng.kv_spec.dtype == expected
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = eng.generate([[1, 2, 3, 4]], params)[0]
    assert len(out.token_ids) == 4



def test_bfloat16_without_native_math_warns(tiny_model_dir, caplog):
    assert slow_bf16_warning(frozenset({"sse4_2"}), panels=False) is not None
    # the AVX2 build's panels run it at float32's speed: nothing to warn of
    assert slow_bf16_warning(frozenset({"avx2", "fma"}), panels=True) is None
    assert slow_bf16_warning(frozenset({"avx512f", "avx512_bf16"}), panels=False) is None
    assert slow_bf16_warning(frozenset()) is None  # flags unknown: nothing to say
    with caplog.at_level(logging.WARNING, logger="pdserve.engine"):
        EngineConfig(model=tiny_model_dir, dtype="bfloat16")
    expected = slow_bf16_warning()
    assert (expected in caplog.text) if expected else "conversions" not in caplog.text
    # and it still serves, on whatever paths this CPU has
    eng = tiny_engine(tiny_model_dir, dtype="bfloat16", num_threads=1)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert len(eng.generate([[1, 2, 3, 4]], params)[0].token_ids) == 4
