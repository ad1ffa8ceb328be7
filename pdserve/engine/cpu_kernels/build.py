"""Compiling the C kernels into one shared library, once per source, compiler and CPU.

The library lands in a cache directory (env PDSERVE_KERNEL_CACHE, else
$XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve) under a name keyed by everything that
changes the binary, so a stale or foreign build is never loaded. It is built for the CPU
it runs on (-march=native); env PDSERVE_KERNEL_MARCH names another target (x86-64-v2, say,
for the portable paths without AVX-512; the tests build those that way). `python -m
pdserve.engine.cpu_kernels.build` builds it ahead of time, at install (the Makefile does, on
the machine that will run it, so the first server start does not compile); without a
working compiler it exits 1 with a one-line error, and the server later starts on the
eager / `torch` fallbacks with a one-line warning naming them (pdserve.engine.layers.registry).

Why -ffast-math stays: the paged decode kernel's portable float loops (dot products, sums,
expf) vectorise only with reassociation. Measured A/B in one process on this 2-core
machine (min of 40 interleaved rounds, one thread, SmolLM2-135M shapes), without it the
decode kernel took 1.0-2.1x as long (float32 1.6-2.1x, bfloat16 1.0-1.1x; row-wise over a
prefill chunk 1.4-2.2x); the narrower -fno-math-errno -fassociative-math -fno-signed-zeros
-fno-trapping-math did not recover it (1.4-2.9x); the prefill kernel, written in AVX-512
intrinsics, did not change (0.9-1.1x). The kernels never rely on NaN or infinity: masked
scores are a finite NEG_BIG (paged_prefill.c), and the tests hold them to the references.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

SOURCES = tuple(pathlib.Path(__file__).with_name(n)
                for n in ("paged_decode.c", "paged_prefill.c", "layer_ops.c", "gemv.c",
                          "decode_stack.c", "crc_copy.c", "kv_ingest.c", "sampling_noise.c",
                          "sampling_filter.c", "argmax.c", "amx_linear.c", "f32_panels.c",
                          "bf16_panels.c", "q4_blocks.c", "team_affinity.c"))
HEADERS = tuple(pathlib.Path(__file__).with_name(n)
                for n in ("common.h", "crc_copy.h", "sampling_noise.h"))
# -ffast-math lets gcc vectorise the float reductions (dot products, sums) and exp2f (kept:
# see the measurement above);
# -fopenmp resolves to the libgomp torch has already loaded (same soname), so the kernel
# shares torch's thread pool instead of starting a second one on the same cores.
CFLAGS = ("-O3", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-shared",
          "-std=c11")
LIBS = ("-lm",)


class KernelBuildError(RuntimeError):
    """No compiler, or the compiler rejected the source."""


def cache_dir() -> pathlib.Path:
    if os.environ.get("PDSERVE_KERNEL_CACHE"):
        return pathlib.Path(os.environ["PDSERVE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "pdserve"


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise KernelBuildError("no C compiler found (install gcc or set CC)")
    return cc


def _cpu_features() -> str:
    # -march=native bakes in this CPU's instruction set: a cache shared with a different
    # CPU (a network home, an image built elsewhere) must not hand it this binary.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def cflags() -> tuple[str, ...]:
    return (f"-march={os.environ.get('PDSERVE_KERNEL_MARCH') or 'native'}", *CFLAGS)


def library_path(cc: str | None = None) -> pathlib.Path:
    cc = cc or compiler()
    h = hashlib.sha256()
    flags = " ".join(cflags() + LIBS)
    for part in (*(src.read_bytes() for src in SOURCES + HEADERS), cc.encode(), flags.encode(),
                 platform.machine().encode(), _cpu_features().encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"pdserve_kernels-{h.hexdigest()[:16]}.so"


def build() -> pathlib.Path:
    """The library's path, compiling it first when the cache lacks it."""
    cc = compiler()
    out = library_path(cc)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name and rename: processes starting together each build and
    # the last rename wins, and nobody ever loads a half-written file
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-kernels-") as objs:
            _compile_and_link(cc, pathlib.Path(objs), tmp)
        os.chmod(tmp, 0o755)  # mkstemp made it private; a shared cache must be loadable
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"could not build the CPU kernels with {cc}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _compile_and_link(cc: str, objs: pathlib.Path, out: str) -> None:
    """Each source to an object, as many at once as this process has cores, then one link:
    one gcc over every source took 10.6 s on two Zen 3 cores, its largest file 2.5 s."""
    def run(args: list[str]) -> None:
        r = subprocess.run(args, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            lines = r.stderr.strip().splitlines()
            # the first line says what went wrong (the one-line summaries print only it)
            first = next((ln for ln in lines if "error" in ln), lines[-1] if lines else
                         f"exit code {r.returncode}")
            raise KernelBuildError(f"{cc} failed to build the CPU kernels: {first.strip()}\n"
                                   + "\n".join(lines))

    targets = [objs / f"{src.stem}.o" for src in SOURCES]
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(min(len(SOURCES), cores)) as pool:
        done = [pool.submit(run, [cc, *cflags(), "-c", str(src), "-o", str(obj)])
                for src, obj in zip(SOURCES, targets)]
        for f in done:  # in source order: the first failing file's error is the one raised
            f.result()
    run([cc, *cflags(), *map(str, targets), "-o", out, *LIBS])


if __name__ == "__main__":
    import sys

    try:
        print(build())
    except KernelBuildError as e:
        first = (str(e).strip().splitlines() or ["unknown error"])[0]
        sys.exit(f"pdserve: CPU kernels not built: {first} (the server will fall back to the "
                 "torch attention backend and eager layer ops)")
