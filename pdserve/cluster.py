"""A pdserve cluster as local child processes: one gateway, N prefill and M decode workers.

Life cycle of a `LocalCluster`:

1. `start()` picks ports (the gateway's HTTP, gRPC and registry ports as configured, 0 = any
   free; every worker's gRPC and metrics ports free and next above the gateway's; ports it
   picks stay below the kernel's ephemeral range, where no outgoing connection can take
   them before the child binds), then spawns each tier with `python -m` in its own
   session (so its own process group, and a Ctrl-C in the terminal reaches only us),
   optionally pinned to CPU cores, its stdout and stderr going to `log_dir/NAME.log`.
2. `wait_healthy(timeout)` polls every child's gRPC health service (`grpc.health.v1`,
   service "") until all are SERVING, the gateway's HTTP `/health` answers 200 and the
   gateway lists every worker (`ListModels`, when it implements it). A child that exits
   meanwhile fails it at once with `ClusterError`, carrying the tail of the child's log.
3. `supervise()` (called every second or so by `pdserve up`) restarts a child that exited,
   on the same command line and ports, after a backoff that doubles with each restart of
   that child (1 s up to 30 s); `restarts` counts them. A child that dies
   `MAX_RESTARTS` times within `RESTART_WINDOW_S` raises `ClusterError` with its log tail:
   it will not come up by itself.
4. `stop(grace)` sends SIGTERM to every child's process group, waits up to `grace`
   seconds, then SIGKILLs whatever group is left. It is idempotent and also runs at
   interpreter exit; children started from the main thread additionally get SIGTERM
   from the kernel if this process dies without stopping them (PR_SET_PDEATHSIG).

`endpoints` (after `start()`) says where everything listens. Nothing here imports the
tiers themselves: the cluster only knows their command lines. Every child gets the
cluster token (`cluster_token`: given, from the environment, or generated here) in its
environment, never in argv, where `ps` would show it.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cluster_auth import TOKEN_ENV

if TYPE_CHECKING:
    from typing_extensions import Self

TIERS = ("gateway", "prefill", "decode")
MAX_RESTARTS = 5  # of one child within RESTART_WINDOW_S: then the cluster gives up
RESTART_WINDOW_S = 60.0
BACKOFF_BASE_S = 1.0  # the first restart's delay; doubles with each further one
MAX_BACKOFF_S = 30.0
MODULES = {"gateway": "pdserve.gateway", "prefill": "pdserve.prefill_worker",
           "decode": "pdserve.decode_worker"}


class ClusterError(RuntimeError):
    """A child failed to start, exited, or the cluster did not become healthy in time."""


# ---------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ClusterConfig:
    """What to start. `engine_args` are passed verbatim to every worker (the flags of
    `pdserve.engine_args`, without `--model`); `gateway_args`, `prefill_args` and
    `decode_args` are extra flags for one tier. `cpus` is "none", "auto" or a spec such
    as "prefill=0,decode=1" (see `assign_cpus`)."""

    model: str = "smollm2-135m"
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    registry_port: int | None = None  # internal registry; None: grpc_port + 1 (or any free)
    disagg_threshold: int | None = None
    engine_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    cpus: str = "none"
    log_dir: str | None = None
    python: str = sys.executable
    env: tuple[tuple[str, str], ...] = ()
    modules: tuple[tuple[str, str], ...] = tuple(MODULES.items())
    cluster_token: str | None = None  # None: env PDSERVE_CLUSTER_TOKEN, else a new one

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("a cluster needs at least one decode worker and >= 0 prefill "
                             f"workers, not prefill={self.num_prefill} decode={self.num_decode}")
        if self.cpus not in ("none", "auto"):
            parse_cpu_spec(self.cpus)  # raises ValueError with the reason


@dataclass(frozen=True)
class WorkerEndpoint:
    name: str
    tier: str
    address: str  # host:port of its gRPC services
    metrics_url: str
    pid: int
    cpus: tuple[int, ...] | None  # None: not pinned


@dataclass(frozen=True)
class Endpoints:
    http_url: str  # the OpenAI-compatible API, e.g. http://127.0.0.1:8000
    grpc_address: str  # the gateway's gRPC, e.g. 127.0.0.1:50051
    gateway_pid: int
    workers: tuple[WorkerEndpoint, ...]
    registry_address: str = ""  # the gateway's internal registry (workers' --gateway)
    gateway_cpus: tuple[int, ...] | None = None  # None: not pinned

    @property
    def metrics_url(self) -> str:
        return f"{self.http_url}/metrics"


@dataclass
class _Child:
    name: str
    tier: str
    argv: list[str]
    grpc_port: int
    metrics_url: str
    log_path: Path
    cpus: tuple[int, ...] | None
    env: tuple[tuple[str, str], ...] = ()  # on top of the cluster's environment
    proc: subprocess.Popen | None = None
    healthy: bool = False
    deaths: list[float] = field(default_factory=list)  # monotonic times it was found dead
    restart_at: float | None = None  # when a dead child is due to be started again


@dataclass(frozen=True)
class HealthStatus:
    """Progress of `wait_healthy`, given to its callback."""

    elapsed_s: float
    ready: dict[str, tuple[int, int]] = field(default_factory=dict)  # tier -> (ready, total)

    @property
    def loading(self) -> list[str]:
        return [t for t, (r, n) in self.ready.items() if r < n]


# ---------------------------------------------------------------------------- CPU pinning


def _parse_cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.replace("+", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def parse_cpu_spec(spec: str) -> dict[str, list[int]]:
    """'prefill=0,decode=1' or 'prefill=0-3,decode=4,5,6' -> {tier: cores}. A comma item
    without '=' continues the previous tier's list; ranges are inclusive."""
    out: dict[str, list[int]] = {}
    tier = None
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            tier, item = (s.strip() for s in item.split("=", 1))
            if tier not in TIERS:
                raise ValueError(f"--cpus: unknown tier {tier!r} (expected one of {TIERS})")
            out.setdefault(tier, [])
        if tier is None:
            raise ValueError(f"--cpus: {spec!r} must start with TIER=CORES")
        try:
            out[tier].extend(_parse_cpu_list(item))
        except ValueError:
            raise ValueError(f"--cpus: bad core list {item!r} in {spec!r}") from None
    return out


def _share(cores: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """Split cores into n contiguous groups; with fewer cores than n, workers share."""
    if n == 0:
        return []
    if len(cores) < n:
        return [(cores[i % len(cores)],) for i in range(n)]
    q, r = divmod(len(cores), n)
    groups, i = [], 0
    for k in range(n):
        size = q + (1 if k < r else 0)
        groups.append(tuple(cores[i:i + size]))
        i += size
    return groups


# ---------------------------------------------------------------------------- layout

# Below this many cores a prefill tier costs more than it saves: it takes a whole core from
# decoding, and the one left prefills a burst slower than the colocated engine chunks it
# into its batch (docs/benchmarks.md, "Served overhead", has the measurements).
DISAGG_MIN_CORES = 4


@dataclass(frozen=True)
class Layout:
    """How many workers of each tier `pdserve up` starts, and why."""

    num_prefill: int
    num_decode: int
    reason: str

    @property
    def name(self) -> str:
        return "disaggregated" if self.num_prefill else "colocated"

    def describe(self) -> str:
        return (f"{self.name}, {self.num_prefill} prefill + {self.num_decode} decode "
                f"worker(s): {self.reason}")


def choose_layout(num_cores: int, num_prefill: int | None = None,
                  num_decode: int | None = None) -> Layout:
    """The layout for a machine with `num_cores` usable cores; a tier size given by the
    user (not None) is kept as given."""
    decode = 1 if num_decode is None else num_decode
    if num_prefill is not None:
        return Layout(num_prefill, decode, f"--prefill {num_prefill} as asked")
    if num_cores < DISAGG_MIN_CORES:
        return Layout(0, decode, f"{num_cores} core(s) < {DISAGG_MIN_CORES}: a prefill "
                      "worker would take a core from decoding; prompts are chunked into the "
                      "decode batch instead")
    return Layout(1, decode, f"{num_cores} cores >= {DISAGG_MIN_CORES}: prefill on its own "
                  "cores, so prompts never stall the decode batch")


def assign_cpus(spec: str, num_prefill: int, num_decode: int,
                available: Sequence[int] | None = None
                ) -> dict[str, list[tuple[int, ...] | None]]:
    """Cores for each worker, per tier: {"prefill": [cores of prefill-0, ...], "decode": ...,
    "gateway": [cores or None]}. "none" pins nothing; "auto" gives the gateway a core of
    its own when there are three or more (its per-token work then never preempts a worker's
    thread mid-step), and splits the rest between the two worker tiers in proportion to
    their sizes (at least one core each when there are two or more); on fewer cores the
    gateway runs on a sole decode worker's cores but its first (`pins_step_thread`), and is
    unpinned otherwise. A spec names each tier's cores, which its workers then split."""
    avail = sorted(available if available is not None else os.sched_getaffinity(0))
    counts = {"gateway": 1, "prefill": num_prefill, "decode": num_decode}
    if spec == "none":
        return {t: [None] * n for t, n in counts.items()}
    if spec == "auto":
        tiers: dict[str, list[int]] = {}
        if len(avail) >= 3:
            tiers["gateway"], avail = avail[-1:], avail[:-1]
        if num_prefill == 0 or len(avail) == 1:
            tiers.update(prefill=avail, decode=avail)
        else:
            k = round(len(avail) * num_prefill / (num_prefill + num_decode))
            k = min(max(k, 1), len(avail) - 1)
            tiers.update(prefill=avail[:k], decode=avail[k:])
    else:
        tiers = parse_cpu_spec(spec)
        bad = sorted({c for cores in tiers.values() for c in cores} - set(avail))
        if bad:
            raise ValueError(f"--cpus: cores {bad} are not available to this process "
                             f"(available: {avail})")
    out: dict[str, list[tuple[int, ...] | None]] = {}
    for t, n in counts.items():
        cores = tiers.get(t)
        out[t] = list(_share(cores, n)) if cores else [None] * n
    if spec == "auto" and out["gateway"] == [None] and len(out["decode"]) == 1:
        decode = out["decode"][0]
        if decode is not None and len(decode) >= 2:
            # no core of its own: the gateway shares the decode worker's cores but its first,
            # where that worker then runs its engine's step thread (`pins_step_thread`)
            out["gateway"] = [decode[1:]]
    return out


def pins_step_thread(worker: tuple[int, ...] | None, gateway: tuple[int, ...] | None) -> bool:
    """True when the gateway runs on a worker's cores other than its first: the worker then
    runs its engine's step thread and its event loop on that first core and the engine's
    other threads beside the gateway (`--pin-threads`). The gateway's per-token work then
    never delays the step thread's serial part, which every step waits for, only the other
    threads, whose unstarted work the step thread takes over (decode_stack.c);
    docs/benchmarks.md, session 36."""
    return (worker is not None and gateway is not None and len(worker) >= 2
            and worker[0] not in gateway and set(gateway) <= set(worker))


# ---------------------------------------------------------------------------- ports


def port_is_free(host: str, port: int) -> bool:
    """True when a server could listen on host:port now. SO_REUSEADDR, as the servers set
    it: sockets of a stopped cluster lingering in TIME_WAIT do not count as in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections and to bind(port 0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports handed to children are picked here and bound by the child seconds later. A port
# from the ephemeral range can be taken in between by any process's outgoing connection
# (a clean-clone CI run lost a gateway's HTTP port that way), so picks stay below it,
# from a random start so two clusters starting at once rarely probe the same ports.
_PICK_FLOOR = 10000


def free_ports(host: str = "127.0.0.1", n: int = 1, taken: frozenset[int] = frozenset(),
               start: int | None = None) -> list[int]:
    """`n` ports a server could listen on now, none in `taken`. Without `start`, or with
    one below the kernel's ephemeral range, they come from below that range, ascending
    from `start` or a random point and wrapping; a `start` the user put elsewhere (next
    to gateway ports they chose) is scanned upwards from there."""
    if n <= 0:
        return []
    hi = _ephemeral_floor()
    lo = _PICK_FLOOR if hi - _PICK_FLOOR >= 1000 else 1024
    if hi - lo < 1000:
        lo, hi = 1024, 65536
    if start is not None and not lo <= start < hi:
        candidates = range(start, 65536)
    else:
        first = start if start is not None else lo + secrets.randbelow(hi - lo)
        candidates = (lo + (first - lo + i) % (hi - lo) for i in range(hi - lo))
    out: list[int] = []
    for port in candidates:
        if port not in taken and port_is_free(host, port):
            out.append(port)
            if len(out) == n:
                return out
    raise ClusterError(f"no {n} free ports on {host} from {start or lo}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(host)[0]


# ---------------------------------------------------------------------------- the cluster


def _resolve_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in the parent: a child between fork and exec must not dlopen."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1


def tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


# libgomp's spin before a waiting thread sleeps, in iterations of its pause loop (~0.1 ms
# by libgomp's own estimate of 100,000 per ms): long enough to span the Python between two
# parallel regions of a step's layer loop (a prefill step runs ~300 regions), short enough
# to give the core back soon after the step ends. docs/benchmarks.md, session 21.
SHARED_CORE_SPINCOUNT = 10_000


def shared_core_openmp_env(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What a worker whose cores another process also runs on (the unpinned gateway,
    another worker) gets on top of `environ`. Its OpenMP threads must not spin on at the end
    of a region while a sibling is descheduled (a step then takes many times its compute:
    docs/benchmarks.md, "Served overhead"), so they wait passively; and a bounded spin first
    (`SHARED_CORE_SPINCOUNT`), since a futex wake-up at every one of a step's regions cost a
    128-token prefill 25-35 %. The user's own settings win."""
    if "OMP_WAIT_POLICY" in environ:
        return ()
    env = [("OMP_WAIT_POLICY", "PASSIVE")]
    if "GOMP_SPINCOUNT" not in environ:
        env.append(("GOMP_SPINCOUNT", str(SHARED_CORE_SPINCOUNT)))
    return tuple(env)


class LocalCluster:
    """One gateway plus `num_prefill` prefill and `num_decode` decode workers as child
    processes on this machine. Also a context manager: start + wait_healthy, then stop."""

    def __init__(self, config: ClusterConfig | None = None, **overrides) -> None:
        cfg = config or ClusterConfig()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config = cfg
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="pdserve-"))
        self._children: list[_Child] = []
        self._endpoints: Endpoints | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.kill_now = threading.Event()  # set it to cut stop()'s grace period short
        self.cluster_token = (cfg.cluster_token or dict(cfg.env).get(TOKEN_ENV)
                              or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32))
        self.restarts = 0  # children restarted by supervise()
        self._env: dict[str, str] = {}
        self._prctl: Callable[..., int] | None = None

    # -- planning

    def _plan(self) -> list[_Child]:
        c = self.config
        host = c.host
        http_port = c.http_port or free_port(host)
        grpc_port = c.grpc_port or free_ports(host, taken=frozenset({http_port}),
                                              start=http_port + 1)[0]
        registry_port = c.registry_port or (c.grpc_port + 1 if c.grpc_port and c.registry_port
                                            is None else 0)
        registry_port = registry_port or free_ports(
            host, taken=frozenset({http_port, grpc_port}),
            start=max(http_port, grpc_port) + 1)[0]
        for what, port in (("HTTP", http_port), ("gRPC", grpc_port),
                           ("registry", registry_port)):
            if not port_is_free(host, port):
                raise ClusterError(f"gateway {what} port {host}:{port} is in use")
        n_workers = c.num_prefill + c.num_decode
        gateway_ports = {http_port, grpc_port, registry_port}
        ports = free_ports(host, 2 * n_workers, frozenset(gateway_ports), max(gateway_ports) + 1)
        cpus = assign_cpus(c.cpus, c.num_prefill, c.num_decode)
        modules = dict(c.modules)
        py = [c.python, "-m"]
        gateway_argv = [*py, modules["gateway"], "--model", c.model, "--host", host,
                        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                        "--registry-port", str(registry_port)]
        if c.disagg_threshold is not None:
            gateway_argv += ["--disagg-threshold", str(c.disagg_threshold)]
        gateway_argv += list(c.gateway_args)
        children = [_Child("gateway", "gateway", gateway_argv, grpc_port,
                           f"http://{host}:{http_port}/metrics", self.log_dir / "gateway.log",
                           cpus["gateway"][0])]
        worker_env: tuple[tuple[str, str], ...] = ()
        if not self._cores_exclusive(cpus):
            worker_env = shared_core_openmp_env({**os.environ, **dict(c.env)})
        gateway_addr = f"{host}:{grpc_port}"
        registry_addr = f"{host}:{registry_port}"
        i = 0
        for tier, n, extra in (("prefill", c.num_prefill, c.prefill_args),
                               ("decode", c.num_decode, c.decode_args)):
            for k in range(n):
                port, mport = ports[i], ports[i + 1]
                i += 2
                name = f"{tier}-{k}"
                core_set = cpus[tier][k]
                argv = [*py, modules[tier], "--model", c.model, "--host", host,
                        "--port", str(port), "--metrics-port", str(mport),
                        "--gateway", registry_addr, "--worker-id", name,
                        *c.engine_args, *extra]
                if core_set is not None and "--threads" not in argv:
                    argv += ["--threads", str(len(core_set))]
                if tier == "decode" and pins_step_thread(core_set, cpus["gateway"][0]):
                    argv.append("--pin-threads")
                children.append(_Child(name, tier, argv, port, f"http://{host}:{mport}/metrics",
                                       self.log_dir / f"{name}.log", core_set, worker_env))
        self._endpoints = Endpoints(
            http_url=f"http://{host}:{http_port}", grpc_address=gateway_addr, gateway_pid=0,
            workers=(), registry_address=registry_addr)
        return children

    @staticmethod
    def _cores_exclusive(cpus: dict[str, list[tuple[int, ...] | None]]) -> bool:
        """True when every process is pinned and no two share a core."""
        seen: set[int] = set()
        for sets in cpus.values():
            for cores in sets:
                if cores is None or seen & set(cores):
                    return False
                seen |= set(cores)
        return True

    # -- life cycle

    def start(self) -> Endpoints:
        """Spawn every child (returns at once; see `wait_healthy`)."""
        assert not self._children, "start() called twice"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        children = self._plan()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(self.config.env),
               TOKEN_ENV: self.cluster_token}
        # PDEATHSIG fires when the *thread* that forked dies: only safe from the main thread
        prctl = _resolve_prctl() if threading.current_thread() is threading.main_thread() else None
        self._env, self._prctl = env, prctl
        atexit.register(self.stop)
        try:
            for ch in children:
                self._children.append(ch)
                ch.proc = self._spawn(ch, env, prctl)
        except BaseException:
            self.stop(grace=2.0)
            raise
        return self.endpoints

    @staticmethod
    def _spawn(ch: _Child, env: dict[str, str],
               prctl: Callable[..., int] | None) -> subprocess.Popen:
        preexec = None
        if prctl is not None and threading.current_thread() is threading.main_thread():
            def preexec() -> None:  # in the child between fork and exec: one syscall through
                prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # a function resolved before fork
        # (a Python preexec in a child forked from any other thread can crash the child
        # before exec — seen as "Fatal Python error: Segmentation fault" under supervise() —
        # so restarts from a supervising thread fork without one: they run in their own
        # session, and stop() ends them)
        with open(ch.log_path, "ab") as log:
            extra = "".join(f"{k}={v} " for k, v in ch.env)
            log.write(f"$ {extra}{' '.join(ch.argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(ch.argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env={**env, **dict(ch.env)},
                                    start_new_session=True, preexec_fn=preexec,
                                    close_fds=True)  # noqa: PLW1509
        if ch.cpus is not None:
            # from the parent, by pid: the child is still starting Python when this lands,
            # long before torch reads its affinity to size its thread pool
            try:
                os.sched_setaffinity(proc.pid, ch.cpus)
            except ProcessLookupError:
                pass  # it died at once; the supervisor sees the exit
        return proc

    @property
    def endpoints(self) -> Endpoints:
        assert self._endpoints is not None, "start() first"
        gw = self._children[0] if self._children else None
        workers = tuple(
            WorkerEndpoint(ch.name, ch.tier, f"{self.config.host}:{ch.grpc_port}",
                           ch.metrics_url, ch.proc.pid if ch.proc else 0, ch.cpus)
            for ch in self._children[1:])
        return Endpoints(self._endpoints.http_url, self._endpoints.grpc_address,
                         gw.proc.pid if gw and gw.proc else 0, workers,
                         self._endpoints.registry_address, gw.cpus if gw else None)

    @property
    def pids(self) -> list[int]:
        return [ch.proc.pid for ch in self._children if ch.proc]

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def failed(self) -> tuple[str, int, str] | None:
        """(name, exit code, log tail) of the first child that has exited, else None."""
        for ch in self._children:
            if ch.proc is not None and ch.proc.poll() is not None:
                return ch.name, ch.proc.returncode, tail(ch.log_path)
        return None

    def supervise(self, log: Callable[[str], None] = lambda line: None) -> None:
        """Restart children that exited (see the module docstring); call it periodically.
        Raises ClusterError when a child keeps dying."""
        now = time.monotonic()
        for ch in self._children:
            if self._stopped or ch.proc is None:
                continue
            if ch.restart_at is None:
                if ch.proc.poll() is None:
                    continue
                ch.deaths = [t for t in ch.deaths if now - t <= RESTART_WINDOW_S] + [now]
                rc = ch.proc.returncode
                if len(ch.deaths) > MAX_RESTARTS:
                    raise ClusterError(
                        f"{ch.name} exited {len(ch.deaths)} times within "
                        f"{RESTART_WINDOW_S:.0f}s (last code {rc}); giving up. Last lines of "
                        f"{ch.log_path}:\n{tail(ch.log_path)}")
                backoff = min(MAX_BACKOFF_S, BACKOFF_BASE_S * 2.0 ** (len(ch.deaths) - 1))
                ch.restart_at = now + backoff
                ch.healthy = False
                log(f"{ch.name} exited with code {rc}; restarting in {backoff:.1f}s "
                    f"(restart {len(ch.deaths)} of at most {MAX_RESTARTS} in "
                    f"{RESTART_WINDOW_S:.0f}s)")
            elif now >= ch.restart_at:
                _killpg(ch.proc.pid, signal.SIGKILL)  # what it left behind
                ch.restart_at = None
                with self._lock:
                    if self._stopped:
                        return
                    ch.proc = self._spawn(ch, self._env, self._prctl)
                self.restarts += 1
                log(f"{ch.name} restarted (pid {ch.proc.pid}); {self.restarts} restart(s) so far")

    def _raise_if_failed(self) -> None:
        f = self.failed()
        if f is not None:
            name, rc, log = f
            raise ClusterError(f"{name} exited with code {rc}; last lines of "
                               f"{self.log_path(name)}:\n{log}")

    def wait_healthy(self, timeout: float = 300.0,
                     progress: Callable[[HealthStatus], None] | None = None,
                     poll_s: float = 0.5) -> Endpoints:
        """Block until every child is healthy and the gateway sees every worker. Raises
        ClusterError (with the failing child's log tail) on exit or timeout."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        assert self._children, "start() first"
        t0 = time.monotonic()
        from pdserve.rpc import RECONNECT_OPTIONS

        # polled from before the children listen. Each check waits for its channel to
        # connect (wait_for_ready), bounded by its timeout: only a call in progress drives a
        # blocking-API channel's connection attempts under grpcio's iomgr client (pdserve's
        # GRPC_EXPERIMENTS), and with fail-fast checks none was: a refused first attempt
        # was retried only at gRPC's 20 s connect timeout, and every cluster took ~20 s to
        # be healthy
        channels = {ch.name: grpc.insecure_channel(f"{self.config.host}:{ch.grpc_port}",
                                                   options=RECONNECT_OPTIONS)
                    for ch in self._children}
        try:
            while True:
                self._raise_if_failed()
                for ch in self._children:
                    if ch.healthy:
                        continue
                    stub = health_pb2_grpc.HealthStub(channels[ch.name])
                    try:
                        r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0,
                                       wait_for_ready=True)
                        ok = r.status == health_pb2.HealthCheckResponse.SERVING
                    except grpc.RpcError:
                        ok = False
                    if ok and ch.tier == "gateway":
                        ok = self._http_ok(f"{self._endpoints.http_url}/health")
                    ch.healthy = ok
                all_up = all(ch.healthy for ch in self._children)
                if all_up and self._gateway_sees_workers(channels["gateway"]):
                    return self.endpoints
                if progress is not None:
                    progress(self._status(time.monotonic() - t0))
                if time.monotonic() - t0 > timeout:
                    waiting = [ch.name for ch in self._children if not ch.healthy]
                    what = ", ".join(waiting) or "the gateway to list every worker"
                    first = waiting[0] if waiting else "gateway"
                    raise ClusterError(
                        f"not healthy after {timeout:.0f}s, waiting for {what}; last lines of "
                        f"{self.log_path(first)}:\n{tail(self.log_path(first))}")
                time.sleep(poll_s)
        finally:
            for ch in channels.values():
                ch.close()

    def _status(self, elapsed: float) -> HealthStatus:
        ready = {}
        for t in TIERS:
            tier = [ch for ch in self._children if ch.tier == t]
            if tier:
                ready[t] = (sum(ch.healthy for ch in tier), len(tier))
        return HealthStatus(elapsed, ready)

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _gateway_sees_workers(self, channel) -> bool:
        """True once ListModels counts every worker; True when the gateway does not
        implement ListModels (then health is all we can know)."""
        import grpc

        try:
            from pdserve.protos.pdserve.v1 import gateway_pb2, gateway_pb2_grpc
        except ImportError:
            return True
        try:
            r = gateway_pb2_grpc.GatewayStub(channel).ListModels(
                gateway_pb2.ListModelsRequest(), timeout=1.0)
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.UNIMPLEMENTED
        c = self.config
        return any(m.num_prefill_workers >= c.num_prefill and m.num_decode_workers >= c.num_decode
                   for m in r.models)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every child's process group, wait up to `grace` seconds (or until
        `kill_now` is set), then SIGKILL what is left. Safe to call more than once."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        procs = [ch.proc for ch in self._children if ch.proc is not None]
        for p in procs:
            _killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            while p.poll() is None and time.monotonic() < deadline and not self.kill_now.is_set():
                time.sleep(0.05)
        for p in procs:
            # the group may outlive its leader (grandchildren): kill the group either way
            _killpg(p.pid, signal.SIGKILL)
            p.wait()
        atexit.unregister(self.stop)

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
