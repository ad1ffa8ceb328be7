"""Hosts for multi-host tests and `pdserve.bench.netns`: Linux network namespaces joined by a
bridge, one namespace per process, each with its own address, and the processes started
inside them.

    bridge namespace <prefix>-br:  br0 ── v0 ─┐ ── v1 ─┐ ...   (no address, no route out)
                                              │        │
    host namespaces <prefix>-<name>:     eth0 10.213.47.2   eth0 10.213.47.3 ...

Every link is created inside the topology's own namespaces (a veth pair is made in the
bridge namespace with its peer moved straight into the host's), so nothing is added to
the machine's root namespace and no packet can leave: deleting the namespaces deletes
every link with them.

Life cycle: `Topology(names)` -> `create()` (first deletes namespaces left by an earlier
run whose process is gone) -> `spawn(name, argv)` starts a process inside `name`'s
namespace in its own process group -> `close()` SIGKILLs the groups it started, waits for
them, and deletes every namespace it made; it runs on any failure and is idempotent.

`unavailable()` says why namespaces cannot be made here (not Linux, not root, no `ip`),
for a skip reason.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.pids import pid_alive

# Lives only inside namespaces a topology owns; no host route can clash with it.
SUBNET = "10.213.47"
PREFIX = "pdsv"
ROOT = Path(__file__).resolve().parent.parent


def unavailable() -> str | None:
    """Why this machine cannot create network namespaces, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if shutil.which("ss") is None:
        return "the `ss` command (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    name: str  # the test's name for it: "gw-a", "prefill", ...
    netns: str  # the namespace, unique to this test run
    address: str  # its only address, on the bridge


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int | None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")




def sweep_stale() -> list[str]:
    """Delete namespaces left by a test run that was killed before its teardown (its pid is
    in the name and no longer runs). Another live run's namespaces are left alone."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    gone = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() \
                and not pid_alive(int(parts[1])):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone.append(name)
    return gone


class Topology:
    """Namespaces `names` on one bridge; `host(name).address` is each one's address."""

    def __init__(self, names: Sequence[str], subnet: str = SUBNET) -> None:
        if len(set(names)) != len(names) or not 0 < len(names) < 250:
            raise ValueError(f"names must be unique, 1..249 of them: {names}")
        self.prefix = f"{PREFIX}-{os.getpid()}-{id(self) % 10_000}"
        self.bridge_ns = f"{self.prefix}-br"
        self.hosts = {n: Host(n, f"{self.prefix}-{n}", f"{subnet}.{i + 2}")
                      for i, n in enumerate(names)}
        self._made: list[str] = []  # namespaces to delete, in creation order
        self._procs: list[subprocess.Popen] = []
        self.cluster_token = secrets.token_urlsafe(24)

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def create(self) -> Topology:
        sweep_stale()
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for h in self.hosts.values():
                self._add_ns(h.netns)
                port = self._port(h.name)
                _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth",
                    "peer", "name", "eth0", "netns", h.netns)
                _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", port, "up")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def env(self) -> dict[str, str]:
        """What every process gets: this checkout first on the path, one thread each, and the
        topology's cluster token (its processes bind non-loopback addresses, which the tiers
        refuse to do without one)."""
        env = dict(os.environ)
        env["PDSERVE_CLUSTER_TOKEN"] = self.cluster_token
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        return env

    def spawn(self, name: str, argv: Sequence[str], log: Path | None = None,
              **popen) -> subprocess.Popen:
        """Start `argv` inside `name`'s namespace (`ip netns exec` execs it: the pid is the
        process itself), in its own process group, stdout+stderr to `log`."""
        out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            p = subprocess.Popen(["ip", "netns", "exec", self.hosts[name].netns, *argv],
                                 cwd=ROOT, env=self.env(), start_new_session=True,
                                 stdout=popen.pop("stdout", out),
                                 stderr=popen.pop("stderr", subprocess.STDOUT), **popen)
        finally:
            if log is not None:
                out.close()  # the child holds its own descriptor
        self._procs.append(p)
        return p

    def link_argv(self, name: str, up: bool) -> list[str]:
        """The command that takes `name`'s link to the bridge down (or up again): its port
        in the bridge namespace, so the host itself keeps its address and sockets, as a
        pulled cable would leave them. Runnable from any namespace (`ip -n`)."""
        return ["ip", "-n", self.bridge_ns, "link", "set", self._port(name),
                "up" if up else "down"]

    def _port(self, name: str) -> str:
        """`name`'s end of its link in the bridge namespace."""
        return f"v{list(self.hosts).index(name)}"

    def set_link(self, name: str, up: bool) -> None:
        _ip(*self.link_argv(name, up)[1:])

    def limit_rate(self, name: str, kbit: int | None, inbound: bool = False) -> None:
        """Cap what `name` sends to `kbit` kbit/s (a token-bucket qdisc on its eth0: packets
        wait, TCP slows, nothing is lost), or with `inbound` what it receives (the same qdisc
        on its port in the bridge namespace, whose sending is the host's receiving); None
        lifts the cap. A transfer then lasts long enough to act on while it is under way.
        RuntimeError where the kernel has no tbf."""
        if inbound:
            ns, dev = self.bridge_ns, self._port(name)
        else:
            ns, dev = self.hosts[name].netns, "eth0"
        if shutil.which("tc") is None:
            raise RuntimeError("the `tc` command (iproute2) is not installed")
        if kbit is None:
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)
            return
        r = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                            "rate", f"{kbit}kbit", "burst", "16kb", "latency", "200ms"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"tc qdisc tbf on {name}: {r.stderr.strip()}")

    def kill(self, p: subprocess.Popen) -> None:
        """SIGKILL one process this topology started (its whole group), and reap it."""
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()

    def run(self, name: str, argv: Sequence[str], timeout: float = 10.0) -> str:
        r = subprocess.run(["ip", "netns", "exec", self.hosts[name].netns, *argv],
                           capture_output=True, text=True, timeout=timeout, check=True)
        return r.stdout

    def listeners(self, name: str) -> list[Listener]:
        """Every listening TCP socket in `name`'s namespace, from `ss -ltnpH`."""
        out = []
        for line in self.run(name, ["ss", "-ltnpH"]).splitlines():
            cols = line.split()
            if len(cols) < 4:
                continue
            addr, _, port = cols[3].rpartition(":")
            pid = None
            if "pid=" in line:
                pid = int(line.split("pid=", 1)[1].split(",", 1)[0])
            addr = addr.strip("[]").removeprefix("::ffff:")  # v4 on a dual-stack socket
            out.append(Listener(addr, int(port), pid))
        return out

    def close(self) -> None:
        for p in self._procs:
            self.kill(p)
        self._procs.clear()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def __enter__(self) -> Topology:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.close()
