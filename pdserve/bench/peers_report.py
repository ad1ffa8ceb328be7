"""The peers run as one markdown table: rows are the metrics of /work/shared/peers.md's
table (plus lost requests, start-up, the CPU guard and pdserve/peer ratios of workload a's
output throughput), columns the systems in run order. Pure formatting of `peers.json`'s
dict: a metric a run did not measure shows as "—".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

DASH = "—"
Result = Mapping[str, Any]  # one system's entry of peers.json "systems"


def num(v: float | None) -> str:
    """Milliseconds and rates as peers.md writes them: one decimal below 100, else whole
    with thousands separators."""
    if v is None:
        return DASH
    return f"{v:.1f}" if abs(v) < 100 else f"{v:,.0f}"


def _report(r: Result, key: str) -> Mapping[str, Any] | None:
    w = r.get("workloads", {}).get(key)
    return None if w is None else w["report"]


def _pair(r: Result, key: str, stat: str, a: str = "p50", b: str = "p95") -> str:
    rep = _report(r, key)
    if rep is None:
        return DASH
    return f"{num(rep[stat][a])}/{num(rep[stat][b])}"


def _throughput(r: Result, key: str, wall: bool = False) -> str:
    rep = _report(r, key)
    if rep is None or not rep["completed"]:
        return DASH
    out = num(rep["output_throughput"])
    return f"{out} ({num(rep['duration_s'])})" if wall else out


def _d(r: Result) -> str:
    rep = _report(r, "d")
    if rep is None:
        return DASH
    return f"{num(rep['ttft_ms']['p50'])} / {num(rep['tpot_ms']['p50'])}"


def _attainment(r: Result) -> str:
    rep = _report(r, "c")
    return DASH if rep is None else f"{rep['slo_attainment']:.3g}"


def _lost(r: Result) -> str:
    parts = []
    for key, w in r.get("workloads", {}).items():
        rep = w["report"]
        short = f" ({rep['short_outputs']} short)" if rep["short_outputs"] else ""
        parts.append(f"{key} {rep['failed']}/{rep['num_requests']}{short}")
    return ", ".join(parts) or DASH


def _rss(r: Result) -> str:
    b = r.get("peak_rss_bytes")
    return f"{b / 2**30:.2f} GiB" if b else DASH


def _startup(r: Result) -> str:
    return " / ".join(num(s) for s in r.get("startup_s", ())) or DASH


def _guard(r: Result) -> str:
    g = r.get("guard")
    if not g:
        return DASH
    note = "" if g["quiet"] else " (not quiet)"
    return f"{g['foreign_cpu_pct']:.0f}% / {g['loadavg'][0]:.2f}{note}"


ROWS: tuple[tuple[str, Callable[[Result], str]], ...] = (
    ("a out tok/s (wall s)", lambda r: _throughput(r, "a", wall=True)),
    ("a TTFT p50/p95 (ms)", lambda r: _pair(r, "a", "ttft_ms")),
    ("a TPOT p50/p95 (ms)", lambda r: _pair(r, "a", "tpot_ms")),
    ("a ITL p50/p95 (ms)", lambda r: _pair(r, "a", "itl_ms")),
    ("b out tok/s", lambda r: _throughput(r, "b")),
    ("c TTFT p50/p95 (ms)", lambda r: _pair(r, "c", "ttft_ms")),
    ("c TPOT p50/p95 (ms)", lambda r: _pair(r, "c", "tpot_ms")),
    ("c SLO attainment", _attainment),
    ("d TTFT / TPOT (ms)", _d),
    ("lost requests (failed/sent)", _lost),
    ("peak RSS (process tree)", _rss),
    ("start-up to healthy (s)", _startup),
    ("CPU guard: foreign CPU / load avg", _guard),
)


def a_throughput(r: Result) -> float | None:
    rep = _report(r, "a")
    return None if rep is None or not rep["completed"] else rep["output_throughput"]


def ratio_rows(systems: Mapping[str, Result]) -> list[tuple[str, list[str]]]:
    """One row per pdserve system: its workload-a out tok/s over each column's."""
    rows = []
    for name, r in systems.items():
        if r["system"]["kind"] != "pdserve":
            continue
        mine = a_throughput(r)
        cells = []
        for other in systems.values():
            theirs = a_throughput(other)
            cells.append(DASH if mine is None or not theirs else f"{mine / theirs:.2f}")
        rows.append((f"a out tok/s: {name} / this", cells))
    return rows


def table(systems: Mapping[str, Result]) -> list[str]:
    names = list(systems)
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    body = [(label, [fn(r) for r in systems.values()]) for label, fn in ROWS]
    for label, cells in body + ratio_rows(systems):
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def render_markdown(doc: Mapping[str, Any]) -> str:
    """peers.md: what was run, the table, and per system how it ran."""
    systems = doc["systems"]
    wl = doc.get("workloads", {})
    described = "; ".join(f"{k} = {w['title']}" + (
        f" (SLO TTFT {w['ttft_slo_s']:g} s / TPOT {w['tpot_slo_s'] * 1000:g} ms)"
        if w.get("ttft_slo_s") else "") for k, w in wl.items())
    lines = ["# pdserve beside vLLM (CPU) and llama.cpp", "",
             f"Written by `{doc.get('command', 'python -m pdserve.bench.peers run')}` "
             f"(`pdserve.bench.peers`) on {doc.get('machine', '?')}, seed {doc.get('seed', 0)}. "
             f"Workloads: {described}. OpenAI `/v1/completions`, streamed, greedy, "
             "`ignore_eos`; TPOT divides by the server's usage count. Each system ran alone "
             "after the CPU guard; its prefix cache was emptied before each workload.", "",
             *table(systems), ""]
    for name, r in systems.items():
        how = "; ".join(f"{k}: {w['prefix_cache']}" for k, w in r.get("workloads", {}).items())
        env = " ".join(f"{k}={v}" for k, v in (r.get("env") or {}).items())
        lines.append(f"- **{name}**: `{(env + ' ') if env else ''}{r.get('command', '?')}`"
                     + (f". Prefix cache per workload: {how}" if how else "")
                     + (f". **Error:** {r['error']}" if r.get("error") else "") + ".")
    return "\n".join(lines) + "\n"
