"""Generates the Python stubs of pdserve's protos; the only way they are ever written.

    python -m pdserve.protos.generate           # rewrite protos/pdserve/v1/*_pb2{.py,.pyi,_grpc.py}
    python -m pdserve.protos.generate --check   # regenerate into a temp dir; exit 1 if they differ

protoc runs from the repository root with `-I .`, so the protos import each other as
`protos/pdserve/v1/<name>.proto`. The folder installs as `pdserve.protos` (pyproject's
package-dir), so the stubs' own imports and module names are rewritten from `protos.` to
`pdserve.protos.` right after protoc writes them — the one edit generated code ever gets.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos/pdserve/v1")  # relative to ROOT
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The .proto files, relative to the repository root."""
    return sorted(p.relative_to(ROOT) for p in (ROOT / PROTO_DIR).glob("*.proto"))


def stub_names(protos: list[Path]) -> list[str]:
    return sorted(p.stem + suffix for p in protos for suffix in STUB_SUFFIXES)


def run_protoc(out_dir: Path) -> None:
    """Writes the stubs of every proto under out_dir/protos/pdserve/v1/."""
    protos = proto_files()
    if not protos:
        raise SystemExit(f"no .proto files under {ROOT / PROTO_DIR}")
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        "-I", ".",
        "-I", str(well_known),
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    result = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"protoc failed ({result.returncode}):\n{result.stderr}")
    for path in (out_dir / PROTO_DIR).glob("*_pb2*"):
        path.write_text(_namespaced(path.read_text()))


def _namespaced(stub: str) -> str:
    """protoc names the stubs' package after the include path (`protos.pdserve.v1`); they
    import as `pdserve.protos.pdserve.v1`."""
    return (stub.replace("from protos.pdserve.v1 import", "from pdserve.protos.pdserve.v1 import")
            .replace("DESCRIPTOR, 'protos.pdserve.v1.", "DESCRIPTOR, 'pdserve.protos.pdserve.v1."))


def check() -> int:
    """0 when the committed stubs equal freshly generated ones, else 1 (with a report)."""
    protos = proto_files()
    expected = stub_names(protos)
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp))
        fresh_dir = Path(tmp) / PROTO_DIR
        committed_dir = ROOT / PROTO_DIR
        problems = []
        for name in expected:
            committed = committed_dir / name
            if not committed.exists():
                problems.append(f"missing: {PROTO_DIR / name}")
            elif not filecmp.cmp(committed, fresh_dir / name, shallow=False):
                problems.append(f"stale: {PROTO_DIR / name}")
        for path in sorted(committed_dir.glob("*_pb2*")):
            if path.name not in expected:
                problems.append(f"no .proto for: {PROTO_DIR / path.name}")
    if problems:
        print("generated stubs are out of date; run `python -m pdserve.protos.generate`:")
        print("\n".join(f"  {p}" for p in problems))
        return 1
    print(f"{len(expected)} stubs up to date")
    return 0


def generate() -> int:
    protos = proto_files()
    committed_dir = ROOT / PROTO_DIR
    for path in committed_dir.glob("*_pb2*"):
        if path.is_file():
            path.unlink()
    run_protoc(ROOT)
    print(f"wrote {len(stub_names(protos))} stubs under {PROTO_DIR}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true",
        help="regenerate into a temp dir and exit 1 if the committed stubs differ",
    )
    args = parser.parse_args(argv)
    return check() if args.check else generate()


if __name__ == "__main__":
    sys.exit(main())
