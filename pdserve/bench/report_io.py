"""Writing a benchmark report: JSON to stdout, and to a file when asked."""

from __future__ import annotations

import json


def emit_report(report: dict, out: str | None) -> None:
    print(json.dumps(report, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
