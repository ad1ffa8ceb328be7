"""The C kernels' other paths: the library built without AVX-512 (PDSERVE_KERNEL_MARCH
x86-64-v2, the portable loops; x86-64-v3, the AVX2 sections), each in a fresh cache, in a
child process so this process keeps its native build, must match the torch references
too. A native build takes one set of paths only (AVX-512 on the Xeons, AVX2 on the EPYCs
this suite also runs on), so without this the others would go untested."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest

CHECK = r"""
import torch
from pdserve.engine.attention.torch_backend import (decode_attention_reference,
                                            prefill_attention_reference)
from pdserve.engine.cpu_kernels.build import library_path
from pdserve.engine.cpu_kernels.paged_decode import paged_decode_attention
from pdserve.engine.cpu_kernels.paged_prefill import paged_prefill_attention
from pdserve.engine.layers.registry import build_layer_ops

def close(got, want, dtype=torch.float32):
    # float32: summation order; bf16 inputs, float32 math, one rounding at the end
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3,
                                                                         rtol=2 ** -8)
    torch.testing.assert_close(got.float(), want, **tol)


gen = torch.Generator().manual_seed(0)
bs, hq, hkv = 16, 6, 2
for d in (64, 128, 48):  # the vector steps' two head dims, and the loops'
    k = torch.randn(40, bs, hkv, d, generator=gen)
    v = torch.randn(40, bs, hkv, d, generator=gen)
    tables = torch.randperm(40, generator=gen).int().view(4, 10)
    for dtype in (torch.float32, torch.bfloat16):
        kc, vc = k.to(dtype), v.to(dtype)
        q = torch.randn(4, hq, d, generator=gen).to(dtype)
        lens = torch.tensor([1, 17, 100, 160], dtype=torch.int32)
        close(paged_decode_attention(q, kc, vc, lens, tables, 0.1),
              decode_attention_reference(q.float(), kc.float(), vc.float(), lens, tables, 0.1),
              dtype)
        chunks = [(5, 5), (30, 100), (70, 70)]  # fresh, over a prefix, more than one tile
        q = torch.randn(105, hq, d, generator=gen).to(dtype)
        close(paged_prefill_attention(q, kc, vc, [c for c, _ in chunks],
                                      [s for _, s in chunks], tables[:3], 0.1),
              prefill_attention_reference(q.float(), kc.float(), vc.float(), [0, 5, 35, 105],
                                          [5, 100, 70], tables[:3], 0.1), dtype)
ref, cpu = (build_layer_ops(n, torch.device('cpu')) for n in ('torch', 'cpu'))
x, delta, w = torch.randn(300, 576), torch.randn(300, 576), torch.randn(576)
close(cpu.add_rms_norm(x.clone(), delta, w, 1e-5), ref.add_rms_norm(x.clone(), delta, w, 1e-5))
gu = torch.randn(300, 3072)
close(cpu.silu_mul(gu), ref.silu_mul(gu))
qk, pos = torch.randn(300, 12, 64), torch.randint(0, 64, (300,))
cos, sin = torch.rand(64, 64), torch.rand(64, 64)
want = ref.rope(qk, ref.rope_tables(pos, cos, sin))
close(cpu.rope(qk.clone(), cpu.rope_tables(pos, cos, sin)), want)
for dtype in (torch.float32, torch.bfloat16):
    for m, k, n in ((1, 576, 300), (5, 100, 33), (11, 17, 7)):
        xs, ws = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        torch.testing.assert_close(cpu.linear(xs, ws).float(), xs.float() @ ws.float().T,
                                   atol=1e-4 if dtype == torch.float32 else 1e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 2 ** -7)
from pdserve.engine.cpu_kernels.gemv import gemv_linear_int8
from pdserve.engine.layers.int8 import int8_linear_reference, quantize_int8
for dtype in (torch.float32, torch.bfloat16):
    for m, k, n in ((1, 576, 300), (5, 100, 33)):  # 100: a partial group of scales
        xs, qw = torch.randn(m, k).to(dtype), quantize_int8(torch.randn(n, k))
        torch.testing.assert_close(gemv_linear_int8(xs, qw.q, qw.scale).double(),
                                   int8_linear_reference(xs, qw),
                                   atol=1e-4 if dtype == torch.float32 else 1e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 2 ** -7)
from pdserve.engine.cpu_kernels.sampling_noise import exponential_noise, exponential_race
from pdserve.engine.sampling_noise import noise_from_keys, race_from_keys
keys = torch.tensor([0, 5, 2**32 - 1])
torch.testing.assert_close(exponential_noise(keys, 9000), noise_from_keys(keys, 9000),
                           rtol=6e-7, atol=0)
logits = torch.randn(3, 9000, generator=gen) * 3
assert torch.equal(exponential_race(logits, keys), race_from_keys(logits, keys))
from pdserve.engine.cpu_kernels.sampling_filter import filtered_race
from pdserve.engine.device_sampler import _top_k_top_p_sorted
from pdserve.engine.sampler import min_p_filter, min_p_threshold
t, k, p = (torch.tensor([0.7, 1.0, 1.3]), torch.tensor([9000, 40, 9000]),
           torch.tensor([0.9, 1.0, 0.95]))
for mp in ([0.0, 0.0, 0.0], [0.05, 0.1, 0.0], [0.0, 0.2, 0.02]):  # alone, after top-k / top-p
    mp = torch.tensor(mp)
    thr = torch.tensor([min_p_threshold(v) for v in mp.tolist()])
    want = min_p_filter(_top_k_top_p_sorted(logits / t[:, None], k, p), thr)
    assert torch.equal(filtered_race(logits, t, k, p, mp, torch.zeros(3), keys),
                       race_from_keys(want, keys))
from pdserve.engine.cpu_kernels.argmax import argmax_rows
logits[1, 4000] = logits[1].max()  # a tie: the first index wins
logits[2, 17] = float("nan")
assert torch.equal(argmax_rows(logits), logits.argmax(-1))
from pdserve.engine.cpu_kernels.amx_linear import amx_available
assert not amx_available()  # the stubs: no tiles in an x86-64-v2 or v3 build
import os
from pdserve.engine.cpu_kernels.f32_panels import f32_pack, f32_panels_linear, panels_available
assert panels_available() == (os.environ["PDSERVE_KERNEL_MARCH"] == "x86-64-v3")  # AVX2 + FMA
if panels_available():
    w = torch.randn(64, 96, generator=gen)
    for m in (5, 13, 16, 64):  # row blocks of 6 and fewer
        xs = torch.randn(m, 96, generator=gen)
        torch.testing.assert_close(f32_panels_linear(xs, f32_pack(w), 64), xs @ w.T,
                                   atol=1e-4, rtol=1e-5)
from pdserve.engine.cpu_kernels import bf16_panels
assert bf16_panels.panels_available() == panels_available()  # v3: the AVX2 form
if bf16_panels.panels_available():
    w = torch.randn(64, 96, generator=gen).bfloat16()
    whole = bf16_panels.bf16_panels_linear(xs := torch.randn(64, 96, generator=gen).bfloat16(),
                                           bf16_panels.bf16_pack(w), 64)
    for m in (5, 13, 16, 64):  # row blocks of 5 and fewer; a row's bits whatever its block
        got = bf16_panels.bf16_panels_linear(xs[:m], bf16_panels.bf16_pack(w), 64)
        assert torch.equal(got, whole[:m]), m
        torch.testing.assert_close(got.double(), xs[:m].double() @ w.double().T,
                                   atol=1e-3, rtol=2 ** -8)
from pdserve.engine import gguf_blocks
from pdserve.engine.cpu_kernels.library import load
lib = load()
assert lib.blocks_fast(0) == (os.environ["PDSERVE_KERNEL_MARCH"] == "x86-64-v3")  # float32
for ggml_type in (gguf_blocks.Q4_1, gguf_blocks.Q8_0):  # the GEMV over blocks: its rows'
    size, fmt = gguf_blocks.FORMATS[ggml_type]
    blocks = torch.randint(0, 256, (37, 640 // 32, size), dtype=torch.uint8, generator=gen)
    scales = 2 if ggml_type == gguf_blocks.Q4_1 else 1
    dm = (torch.randn(37, 640 // 32, scales, generator=gen) * 0.05).to(torch.float16)
    blocks[..., :2 * scales] = dm.view(torch.uint8).reshape(37, 640 // 32, 2 * scales)
    blocks = blocks.reshape(37, -1)
    w = gguf_blocks.dequantize(blocks, 640, ggml_type)
    for m in range(1, 10):
        xs = torch.randn(m, 640, generator=gen)
        ours, rows = torch.empty(m, 37), torch.empty(m, 37)
        lib.blocks_linear(xs.data_ptr(), blocks.data_ptr(), fmt, ours.data_ptr(), m, 37, 640,
                          0, 2)
        lib.gv_linear(xs.data_ptr(), 640, w.data_ptr(), None, rows.data_ptr(), 37, m, 37, 640,
                      0, 2)
        if m <= 4 and lib.blocks_fast(0):  # the vector form sums as the row GEMV does
            assert torch.equal(ours, rows), (ggml_type, m)
        torch.testing.assert_close(ours, rows, atol=1e-4, rtol=1e-5)
print(library_path())
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v2/v3 are x86-64 targets")
@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
def test_build_without_avx512_matches_references(tmp_path, march):
    env = dict(os.environ, PDSERVE_KERNEL_MARCH=march,
               PDSERVE_KERNEL_CACHE=str(tmp_path / "kernels"))
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                       timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr[-3000:]
    lib = r.stdout.strip().splitlines()[-1]
    assert lib.startswith(str(tmp_path / "kernels"))
    if shutil.which("objdump"):  # the point: no AVX-512 (zmm) instruction in this build
        asm = subprocess.run(["objdump", "-d", lib], capture_output=True, text=True).stdout
        assert asm and "zmm" not in asm
        # and v3's AVX2 sections are in it: the int8 dot products' vpmaddubsw
        assert ("vpmaddubsw" in asm) == (march == "x86-64-v3")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 targets")
@pytest.mark.parametrize("march", ["skylake-avx512", "sapphirerapids"])
def test_other_x86_targets_compile(tmp_path, march):
    # Each ISA section is compiled only where its macros are defined: AVX-512 without VNNI
    # (Skylake) mixes the AVX-512 dot products with AVX2's int8 ones, Sapphire Rapids takes
    # AMX and AVX512-BF16. This machine may run neither, but the library must build for both.
    env = dict(os.environ, PDSERVE_KERNEL_MARCH=march,
               PDSERVE_KERNEL_CACHE=str(tmp_path / "kernels"))
    r = subprocess.run([sys.executable, "-m", "pdserve.engine.cpu_kernels.build"], env=env,
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().startswith(str(tmp_path / "kernels"))
