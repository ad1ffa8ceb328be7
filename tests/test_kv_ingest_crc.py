"""The fused copy + CRC-32C (engine/cpu_kernels/crc_copy.c, `pdserve::copy_crc32c`) against
its reference, a plain copy and the `crc32c` package: every compiled path (VPCLMULQDQ
folding, SSE4.2 lanes, portable tables) at every length up to past the folding path's
thresholds and on large buffers at odd offsets; the receiver's ingest through each path;
the shared-memory sender's copy into the segment with and without the C op; and the
builds for targets without AVX-512 or without SSE4.2, each holding only its own paths."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from crc32c import crc32c

from pdserve.engine.cpu_kernels.crc_copy import compiled_paths, copy_crc32c
from pdserve.engine.cpu_kernels.kv_ingest import ingest_kv_blocks
from pdserve.kvtransfer.wire import (
    _copy_crc32c_op,
    _copy_with_crc32c,
    encode_layer,
    encode_layer_descriptors,
)
from pdserve.protos.pdserve.v1 import kvtransfer_pb2

PATHS = ("auto", *compiled_paths())
GUARD = 64  # bytes around each destination that must stay as they were


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _copy_and_check(src: torch.Tensor, crc: int, path: str, dst_offset: int = 0) -> None:
    n = src.numel()
    out = _bytes(n + 2 * GUARD + dst_offset, seed=n + 1)
    before = out.clone()
    at = GUARD + dst_offset
    got = copy_crc32c(out[at:at + n], src, crc, path)
    assert got == crc32c(src.numpy().tobytes(), crc), (path, n)
    assert torch.equal(out[at:at + n], src), (path, n)
    assert torch.equal(out[:at], before[:at]) and torch.equal(out[at + n:], before[at + n:])


def test_paths_compiled_here():
    assert compiled_paths()[0] == "portable"
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if platform.machine() == "x86_64" and " sse4_2" in flags:
        assert "sse42" in compiled_paths()  # built with -march=native
    if platform.machine() == "x86_64" and " vpclmulqdq" in flags and " avx512f" in flags:
        assert "vpclmul" in compiled_paths()


@pytest.mark.parametrize("path", PATHS)
def test_every_short_length(path):
    """0..300 bytes (every tail of every stride) and the folding path's thresholds (a
    256-byte round, 512 bytes before it starts) with their neighbours."""
    data = _bytes(1100, seed=0)
    lengths = [*range(301), *range(500, 530), *range(760, 780), 1023, 1024, 1025]
    for n in lengths:
        _copy_and_check(data[1:1 + n], 0, path)
        _copy_and_check(data[3:3 + n], 0xDEADBEEF, path, dst_offset=5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("src_offset", [0, 1, 7, 13])
def test_large_buffers_at_odd_offsets(path, src_offset):
    """4 MiB-ish: many long SSE4.2 strides and folding rounds, then every tail at once."""
    n = (4 << 20) + 12288 + 777
    data = _bytes(n + 16, seed=src_offset)
    _copy_and_check(data[src_offset:src_offset + n], 12345, path, dst_offset=3)


@pytest.mark.parametrize("path", PATHS)
def test_running_crc_over_parts(path):
    """A buffer cut anywhere and copied part by part, each call continuing the last's CRC:
    the whole buffer's CRC (what the sender does with a chunk's K and V)."""
    data = _bytes(100_000, seed=5)
    cuts = [0, 1, 9, 300, 4000, 4001, 61_234, 99_999, 100_000]
    out = torch.zeros_like(data)
    crc = 0
    for a, b in zip(cuts, cuts[1:]):
        crc = copy_crc32c(out[a:b], data[a:b], crc, path)
    assert crc == crc32c(data.numpy().tobytes()) and torch.equal(out, data)


def test_any_dtype_is_its_bytes():
    src = torch.randn(3, 5, 7).to(torch.bfloat16)
    out = torch.empty(src.numel() * 2, dtype=torch.uint8)
    assert copy_crc32c(out, src) == crc32c(src.view(torch.uint8).numpy().tobytes())
    assert torch.equal(out.view(torch.bfloat16).view(3, 5, 7), src)


@pytest.mark.parametrize(("what", "match"), [
    ("dst_dtype", "^dst must be uint8"), ("dst_short", "^dst must be uint8"),
    ("src_strided", "^src must be"), ("dst_strided", "^dst must be"),
    ("crc_negative", "^crc must be"), ("crc_wide", "^crc must be"),
    ("path_unknown", "^path must be"),
])
def test_checks_before_c(what, match):
    src, dst, crc, path = torch.ones(16), torch.zeros(64, dtype=torch.uint8), 0, "auto"
    if what == "dst_dtype":
        dst = torch.zeros(16)
    elif what == "dst_short":
        dst = dst[:63]
    elif what == "src_strided":
        src = torch.ones(32)[::2]
    elif what == "dst_strided":
        dst = torch.zeros(128, dtype=torch.uint8)[::2]
    elif what == "crc_negative":
        crc = -1
    elif what == "crc_wide":
        crc = 1 << 32
    else:
        path = "avx1024"
    with pytest.raises(ValueError, match=match):
        copy_crc32c(dst, src, crc, path)
    assert not dst.any()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("block_shape", [(1, 1, 3), (16, 3, 64), (16, 3, 65)])
def test_ingest_through_each_path(path, block_shape):
    gen = torch.Generator().manual_seed(1)
    kc, vc = (torch.randn(40, *block_shape, generator=gen) for _ in "kv")
    k, v = (torch.randn(9, *block_shape, generator=gen) for _ in "kv")
    ids = torch.randperm(40, generator=gen)[:9]
    want_k, want_v = kc.clone(), vc.clone()
    want_k[ids], want_v[ids] = k, v
    crc = ingest_kv_blocks(kc, vc, ids, k, v, path=path)
    assert crc == crc32c(v.numpy().tobytes(), crc32c(k.numpy().tobytes()))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("with_op", [True, False])
def test_sender_copy_into_segment(with_op):
    """The shm sender's copy of one part: the C op and, without a compiler, the Python
    pieces (256 KiB, so this part spans several) give the same bytes and CRC."""
    op = _copy_crc32c_op() if with_op else None
    assert (op is not None) == with_op  # the kernels build on this machine
    part = torch.randn(700_001)  # 2.8 MB: eleven pieces and a tail
    seg = memoryview(bytearray(part.numel() * 4 + 100))
    crc = _copy_with_crc32c(seg, 33, part, 777, op)
    raw = part.numpy().tobytes()
    assert crc == crc32c(raw, 777) and bytes(seg[33:33 + len(raw)]) == raw
    assert not any(seg[:33]) and not any(seg[33 + len(raw):])


def test_descriptors_match_encode_layer_across_chunks():
    """Several chunks of a bfloat16 layer packed into a segment from an odd offset: each
    header's CRC-32C is encode_layer's, each payload lands at its descriptor."""
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(7, 16, 3, 64, generator=gen).to(torch.bfloat16) for _ in "kv")
    ids = [4, 0, 6, 1, 2, 3, 5]
    block = 16 * 3 * 64 * 2
    seg = memoryview(bytearray(7 * 2 * block + 1000))
    plain = list(encode_layer("r", 3, ids, k, v, first_seq=5, max_chunk_bytes=3 * 2 * block))
    with_shm = list(encode_layer_descriptors("r", 3, ids, k, v, seg, offset=101, first_seq=5,
                                             max_chunk_bytes=3 * 2 * block))
    assert len(plain) == len(with_shm) == 3
    for want, got in zip(plain, with_shm):
        chunk = kvtransfer_pb2.KVMessage.FromString(got.data).chunk
        assert chunk.crc32c == want.crc32c and chunk.seq == want.seq
        at, length = chunk.shm.offset, chunk.shm.length
        assert bytes(seg[at:at + length]) == want.payload
    assert not any(seg[:101])


BUILD_CHECK = r"""
import torch
from crc32c import crc32c
from pdserve.engine.cpu_kernels.build import library_path
from pdserve.engine.cpu_kernels.crc_copy import compiled_paths, copy_crc32c

print(",".join(compiled_paths()))
src = torch.randint(0, 256, (70_001,), dtype=torch.uint8)
for n in (*range(600), 70_000):
    out = torch.zeros(n, dtype=torch.uint8)
    assert copy_crc32c(out, src[1:1 + n], 99) == crc32c(src[1:1 + n].numpy().tobytes(), 99)
    assert torch.equal(out, src[1:1 + n])
print(library_path())
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 targets")
@pytest.mark.parametrize(("march", "paths"), [
    ("x86-64-v2", "portable,sse42"),  # SSE4.2 without AVX-512: the folding path not built
])
def test_build_without_avx512(tmp_path, march, paths):
    """A build for an older target compiles (the VPCLMULQDQ code is guarded out), lists
    only its paths, and its best one matches the reference; in a child process with a
    fresh kernel cache (this process keeps its native build). The x86-64 (v1) build, with
    neither, is tests/test_kv_ingest.py's."""
    env = dict(os.environ, PDSERVE_KERNEL_MARCH=march,
               PDSERVE_KERNEL_CACHE=str(tmp_path / "kernels"))
    r = subprocess.run([sys.executable, "-c", BUILD_CHECK], env=env, capture_output=True,
                       text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == paths and lines[-1].startswith(str(tmp_path / "kernels"))
    if shutil.which("objdump"):
        asm = subprocess.run(["objdump", "-d", lines[-1]], capture_output=True,
                             text=True).stdout
        assert re.search(r"\tcrc32", asm) and not re.search(r"\tvpclmulqdq", asm)


def test_schemas_and_fakes():
    """Typed at the call (the dispatcher checks the types), and the fakes run the same checks
    on metadata alone."""
    ops = torch.ops.pdserve
    assert str(ops.copy_crc32c.default._schema) == (
        "pdserve::copy_crc32c(Tensor(a0!) dst, Tensor src, SymInt crc=0, str path=\"auto\") "
        "-> SymInt")
    assert str(ops.ingest_kv_blocks.default._schema).endswith(
        "Tensor k, Tensor v, SymInt crc=0, str path=\"auto\") -> SymInt")
    with pytest.raises(RuntimeError):
        copy_crc32c(torch.zeros(4, dtype=torch.uint8), torch.ones(1), "0")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        dst, src = torch.empty(8, dtype=torch.uint8), torch.empty(2)
        assert copy_crc32c(dst, src, 5) == 0
        with pytest.raises(ValueError, match="^dst must be uint8"):
            copy_crc32c(dst[:7], src)
