"""EngineConfig: every knob of one engine instance, validated in one place; `dtype="auto"`
is resolved here, once, to the dtype this machine computes fastest."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from pdserve.engine.kv_cache import dtype_from_name, parse_bytes

log = logging.getLogger("pdserve.engine")

# CPU flags (as /proc/cpuinfo spells them) of native bfloat16 matrix math: AVX512-BF16's dot
# products, AMX's tiles. Without them --dtype auto keeps float32: on an AVX2 CPU bfloat16
# runs on float32 FMAs over widened weights (bf16_panels.c), as fast as float32 or faster
# in batches (half the bytes), but no closer to the checkpoint's float32 results.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's feature flags; empty where the file is not there (not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def auto_dtype(device: str, flags: frozenset[str] | None = None,
               panels: bool | None = None) -> tuple[str, str]:
    """(dtype, why) for --dtype auto: bfloat16 on a CPU with native bfloat16 math and on
    CUDA devices that support it, float16 on other CUDA devices, float32 otherwise. Where
    float32 is picked on a CPU whose kernel build has bfloat16 panels (`panels`, asked of
    the build where None), `why` says what --dtype bfloat16 would give instead."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", "the GPU supports bfloat16"
        return "float16", "the GPU lacks bfloat16"
    if device != "cpu":
        return "float32", f"device {device!r}"
    found = sorted(set(BF16_CPU_FLAGS) & (cpu_flags() if flags is None else flags))
    if found:
        return "bfloat16", f"this CPU has {', '.join(found)}"
    why = f"this CPU has none of {', '.join(BF16_CPU_FLAGS)}"
    if _build_has_bf16_panels() if panels is None else panels:
        why += ("; --dtype bfloat16 would run on this build's bfloat16 panels: half the "
                "weights' memory, faster batches, values further from the checkpoint's")
    return "float32", why


def slow_bf16_warning(flags: frozenset[str] | None = None,
                      panels: bool | None = None) -> str | None:
    """What to warn of when bfloat16 is asked for on this CPU, or None. A CPU without native
    bfloat16 math whose kernel build has no bfloat16 panels either (`panels`, asked of the
    build where None; an x86-64 CPU without AVX2, say) runs bfloat16 through torch's
    conversions: it halves the weights' memory but computes several times slower than
    float32 (5x on a Zen 3 before the AVX2 panels). Nothing where the flags are unknown (no
    /proc/cpuinfo)."""
    flags = cpu_flags() if flags is None else flags
    if not flags or set(BF16_CPU_FLAGS) & flags:
        return None
    if panels is None:
        panels = _build_has_bf16_panels()
    if panels:
        return None
    return (f"dtype bfloat16 on a CPU with none of {', '.join(BF16_CPU_FLAGS)} and no "
            f"bfloat16 panels in the kernel build: it runs through conversions, several times "
            f"slower than float32 (--dtype auto picks float32 here)")


def _build_has_bf16_panels() -> bool:
    """Whether the CPU kernels built here have bfloat16 panels (False where they do not
    build: then nothing of bfloat16 is fast)."""
    from pdserve.engine.cpu_kernels.bf16_panels import panels_available
    from pdserve.engine.cpu_kernels.build import KernelBuildError

    try:
        return panels_available()
    except KernelBuildError:
        return False


# Whether overlap_scheduling=auto turns overlap on for a CPU engine (see overlap_enabled).
# Off: on the CPU a launch finishes before it returns, so nothing overlaps. Measured once
# (tiny model, batch 16 decode, one engine, 16 interleaved on/off rounds of 15 steps, on a
# 2-core machine at load ~6): host time per step outside the forward, median 2.9 ms off,
# 2.2 ms on (min 0.80 / 0.46): no growth beyond the noise, and no gain to switch on for.
OVERLAP_ON_CPU = False
# Weight formats besides the model dtype (pdserve.engine.layers.int8); None: the model dtype.
QUANTIZATIONS = ("int8",)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"  # float32 | bfloat16 (| float16 on GPU) | auto (see auto_dtype)
    kv_cache_dtype: str | None = None  # None: the model's dtype
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: str | int = "1GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests use small pools)
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 256
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    attention_backend: str = "auto"  # auto | torch | cpu | triton
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; default: all usable cores
    show_progress: bool = True
    enforce_eager: bool = False  # CUDA: no decode graphs (every step launched op by op)
    # schedule step N+1 while N runs (pdserve.engine.overlap): auto | on | off
    overlap_scheduling: str = "auto"
    # None, or "int8": weight-only int8 projections and LM head (pdserve.engine.layers.int8),
    # read by the CPU's batch-1..4 decode stack; CPU only
    quantization: str | None = None
    # a model de-quantized from a Q4_1 GGUF: its CPU decode stack streams the weights' blocks
    # (the same values, 0.625 bytes a weight; pdserve.engine.gguf_blocks)
    gguf_blocks: bool = True

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            dtype, why = auto_dtype(self.device)
            log.info("dtype auto: %s (%s)", dtype, why)
            object.__setattr__(self, "dtype", dtype)  # resolved once: the config stays frozen
        elif self.dtype == "bfloat16" and self.device == "cpu":
            warning = slow_bf16_warning()
            if warning:
                log.warning("%s", warning)
        dtype_from_name(self.dtype)
        dtype_from_name(self.cache_dtype)
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got "
                             f"{self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        parse_bytes(self.kv_cache_memory)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be {' or '.join(QUANTIZATIONS)} or none, got "
                             f"{self.quantization!r}")
        if self.quantization and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization} runs on the CPU only (its "
                             f"kernels are the CPU decode stack's), not on {self.device}")
        if self.overlap_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"overlap_scheduling must be auto, on or off, got "
                             f"{self.overlap_scheduling!r}")

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype: kv_cache_dtype, else the model's."""
        return self.kv_cache_dtype or self.dtype

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)

    @property
    def overlap_enabled(self) -> bool:
        """auto: on for CUDA; off elsewhere, where a launch finishes before it returns and
        there is nothing to overlap (OVERLAP_ON_CPU says what was measured)."""
        if self.overlap_scheduling == "auto":
            return self.device.startswith("cuda") or OVERLAP_ON_CPU
        return self.overlap_scheduling == "on"

    def threads(self) -> int:
        if self.num_threads:
            return self.num_threads
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:
            return os.cpu_count() or 1
