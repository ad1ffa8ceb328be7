"""`host:port` lists as command lines give them: comma-separated, repeatable flags, each
entry checked for a host and a numeric port. One parser for every tier's address flags."""

from __future__ import annotations

from collections.abc import Iterable


def addresses(spec: str | Iterable[str] | None, what: str = "worker address") -> list[str]:
    """'host:port,host:port' (or several such strings) -> ['host:port', ...] in order,
    duplicates dropped. Raises ValueError naming `what` for an entry without a port."""
    parts = [spec] if isinstance(spec, str) else list(spec or ())
    out: list[str] = []
    for part in (p.strip() for s in parts for p in s.split(",")):
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{what} {part!r} is not host:port")
        if part not in out:
            out.append(part)
    return out
