"""Received KV into the cache in one pass (engine/cpu_kernels/kv_ingest.c,
`pdserve::ingest_kv_blocks`) against its reference, `copy_blocks` plus the `crc32c`
package; its input checks; `kv_blocks.ingest_blocks` in both of its modes; and the
portable CRC-32C (a build without SSE4.2) against the same reference."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch
from crc32c import crc32c

from pdserve.engine.cpu_kernels.kv_ingest import ingest_kv_blocks
from pdserve.engine.kv_blocks import ChecksumMismatch, copy_blocks, ingest_blocks


def _crc(k: torch.Tensor, v: torch.Tensor) -> int:
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8).numpy().tobytes()  # noqa: E731
    return crc32c(as_bytes(v), crc32c(as_bytes(k)))


def _case(block_shape: tuple[int, ...], dtype: torch.dtype, n: int, num_blocks: int,
          seed: int):
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(num_blocks, *block_shape, generator=gen).to(dtype) for _ in "kv"]
    k, v = (torch.randn(n, *block_shape, generator=gen).to(dtype) for _ in "kv")
    ids = torch.randperm(num_blocks, generator=gen)[:n]
    return caches, k, v, ids


# block bytes: 4 (less than one 8-byte word), 12 (a word and a tail), 768 (three short
# lanes), 12288 (SmolLM2's float32 block: one long stride), 12288 + 52 (every path at once)
SHAPES = [(1, 1, 1), (1, 1, 3), (4, 3, 16), (16, 3, 64), (16, 3, 64 + 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_shape", SHAPES)
@pytest.mark.parametrize("n", [1, 3, 17])
def test_ingest_matches_copy_and_crc32c(dtype, block_shape, n):
    (kc, vc), k, v, ids = _case(block_shape, dtype, n, 40, seed=n)
    want_k, want_v = kc.clone(), vc.clone()
    copy_blocks(want_k, ids.tolist(), k)
    copy_blocks(want_v, ids.tolist(), v)
    assert ingest_kv_blocks(kc, vc, ids, k, v) == _crc(k, v)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # and nothing else changed


def test_ingest_of_no_blocks():
    kc = torch.zeros(4, 2, 2)
    empty = torch.empty(0, 2, 2)
    assert ingest_kv_blocks(kc, kc.clone(), torch.empty(0, dtype=torch.int64), empty,
                            empty) == crc32c(b"")


@pytest.mark.parametrize(("what", "match"), [
    ("id_high", "^block_ids: 10 outside"), ("id_negative", "^block_ids: -1 outside"),
    ("ids_int32", "^block_ids must be"), ("ids_short", "^block_ids must be"),
    ("k_shape", "^k must be"), ("v_dtype", "^v must be"), ("k_strided", "^k must be"),
    ("cache_strided", "^k_cache must be"), ("caches_differ", "^v_cache"),
])
def test_ingest_checks_before_c(what, match):
    kc, vc = torch.zeros(10, 4, 2), torch.zeros(10, 4, 2)
    k, v = torch.ones(2, 4, 2), torch.ones(2, 4, 2)
    ids = torch.tensor([3, 5])
    if what == "id_high":
        ids = torch.tensor([3, 10])
    elif what == "id_negative":
        ids = torch.tensor([-1, 5])
    elif what == "ids_int32":
        ids = ids.int()
    elif what == "ids_short":
        ids = ids[:1]
    elif what == "k_shape":
        k = torch.ones(2, 4, 3)
    elif what == "v_dtype":
        v = v.double()
    elif what == "k_strided":
        k = torch.ones(2, 8, 2)[:, ::2]
    elif what == "cache_strided":
        kc = torch.zeros(10, 8, 2)[:, ::2]
    else:
        vc = torch.zeros(11, 4, 2)
    with pytest.raises(ValueError, match=match):
        ingest_kv_blocks(kc, vc, ids, k, v)
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("exclusive", [True, False])
def test_ingest_blocks_good_and_bad_bytes(exclusive):
    (kc, vc), k, v, ids = _case((16, 3, 64), torch.float32, 5, 30, seed=3)
    ids = ids.tolist()
    others = [b for b in range(30) if b not in ids]
    before_k, before_v = kc.clone(), vc.clone()
    ingest_blocks([(kc, vc)], ids, k[None], v[None], _crc(k, v), exclusive=exclusive)
    assert torch.equal(kc[ids], k) and torch.equal(vc[ids], v)
    assert torch.equal(kc[others], before_k[others])
    bad_v = v.clone()
    bad_v.view(-1)[-1] += 1.0  # the payload's last element
    written_k, written_v = kc.clone(), vc.clone()
    with pytest.raises(ChecksumMismatch, match="^crc32c"):
        ingest_blocks([(kc, vc)], ids, (k * 2)[None], bad_v[None], _crc(k * 2, v),
                      exclusive=exclusive)
    # never outside the blocks named; inside them only when they are the writer's alone
    assert torch.equal(kc[others], before_k[others]) and torch.equal(vc[others],
                                                                     before_v[others])
    if exclusive:
        assert torch.equal(kc[ids], k * 2) and torch.equal(vc[ids], bad_v)
    else:
        assert torch.equal(kc, written_k) and torch.equal(vc, written_v)


def test_ingest_continues_a_crc():
    (kc, vc), k, v, ids = _case((4, 3, 16), torch.float32, 6, 20, seed=5)
    head = crc32c(b"the layers before")
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8).numpy().tobytes()  # noqa: E731
    assert ingest_kv_blocks(kc, vc, ids, k, v, crc=head) == crc32c(
        as_bytes(v), crc32c(as_bytes(k), head))
    with pytest.raises(ValueError, match="^crc must be a uint32"):
        ingest_kv_blocks(kc, vc, ids, k, v, crc=1 << 32)


@pytest.mark.parametrize("exclusive", [True, False])
def test_ingest_blocks_of_several_layers(exclusive):
    """One chunk of three layers: one CRC over K0 V0 K1 V1 K2 V2, each layer into its own
    caches; a bad byte in the last layer fails the whole chunk."""
    cases = [_case((4, 3, 16), torch.float32, 4, 12, seed=10 + i) for i in range(3)]
    ids = cases[0][3].tolist()
    caches = [c[0] for c in cases]
    k = torch.stack([c[1] for c in cases])
    v = torch.stack([c[2] for c in cases])
    crc = 0
    for i in range(3):
        crc = crc32c(v[i].numpy().tobytes(), crc32c(k[i].numpy().tobytes(), crc))
    before = [(kc.clone(), vc.clone()) for kc, vc in caches]
    bad_v = v.clone()
    bad_v[2].view(-1)[-1] += 1.0
    with pytest.raises(ChecksumMismatch):
        ingest_blocks([tuple(c) for c in caches], ids, k, bad_v, crc, exclusive=exclusive)
    if not exclusive:  # checked before anything is written
        assert all(torch.equal(kc, bk) and torch.equal(vc, bv)
                   for (kc, vc), (bk, bv) in zip(caches, before))
    ingest_blocks([tuple(c) for c in caches], ids, k, v, crc, exclusive=exclusive)
    for i, (kc, vc) in enumerate(caches):
        assert torch.equal(kc[ids], k[i]) and torch.equal(vc[ids], v[i])
    with pytest.raises(ValueError, match="2 layers of caches"):
        ingest_blocks([tuple(c) for c in caches[:2]], ids, k, v, crc, exclusive=exclusive)


PORTABLE_CHECK = r"""
import torch
from crc32c import crc32c
from pdserve.engine.cpu_kernels.build import library_path
from pdserve.engine.cpu_kernels.crc_copy import compiled_paths
from pdserve.engine.cpu_kernels.kv_ingest import ingest_kv_blocks

assert compiled_paths() == ("portable",), compiled_paths()

gen = torch.Generator().manual_seed(0)
for shape in ((1, 1, 1), (1, 1, 3), (16, 3, 64), (16, 3, 65)):
    kc, vc = torch.zeros(20, *shape), torch.zeros(20, *shape)
    k, v = torch.randn(7, *shape, generator=gen), torch.randn(7, *shape, generator=gen)
    ids = torch.randperm(20, generator=gen)[:7]
    crc = ingest_kv_blocks(kc, vc, ids, k, v)
    assert crc == crc32c(v.numpy().tobytes(), crc32c(k.numpy().tobytes())), shape
    assert torch.equal(kc[ids], k) and torch.equal(vc[ids], v)
print(library_path())
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 (v1) is an x86-64 target")
def test_portable_crc_without_sse42(tmp_path):
    """The slicing-by-8 CRC of a build without SSE4.2 (plain x86-64), in a child process
    with a fresh kernel cache (this process keeps its native build)."""
    env = dict(os.environ, PDSERVE_KERNEL_MARCH="x86-64",
               PDSERVE_KERNEL_CACHE=str(tmp_path / "kernels"))
    r = subprocess.run([sys.executable, "-c", PORTABLE_CHECK], env=env, capture_output=True,
                       text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr[-3000:]
    lib = r.stdout.strip().splitlines()[-1]
    assert lib.startswith(str(tmp_path / "kernels"))
    if shutil.which("objdump"):  # the point: the software path, not the instruction
        asm = subprocess.run(["objdump", "-d", lib], capture_output=True, text=True).stdout
        assert asm and not re.search(r"\tcrc32", asm)  # the instruction, not a name
