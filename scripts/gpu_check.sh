#!/usr/bin/env bash
# One prepared GPU check (scripts/gpu_check.py): compiles and measures the Triton kernels and
# the engine on an NVIDIA GPU and writes ONE JSON report in under 8 minutes.
#
#   scripts/gpu_check.sh [--out PATH] [--only a,b] [--dry-run]
#   scripts/gpu_check.sh --prepare     # here, before a GPU run: wheels + tokenizer to carry
#
# The GPU machine has no network and lacks grpcio-health-checking, grpcio-reflection and
# crc32c (its grpcio / protobuf may be older than pyproject's floors): --prepare downloads
# them as CPython 3.12 manylinux wheels into .whl/ and saves SmolLM2's tokenizer files into
# .gpu_assets/ (both git-ignored; carry both). On the GPU, when any of them is missing or too
# old, every wheel in .whl/ is installed into a private --target put first on PYTHONPATH.
#
# Report: --out, else $OUT/gpu_report.json when $OUT is set, else ./gpu_report.json.
# Python: $PYTHON if set, else the first of python3 / .venv/bin/python whose torch sees a
# GPU; failing that a venv (.venv-gpu, inheriting system packages) with what is missing
# pip-installed. --dry-run (CPU) only needs a python with torch and triton.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
for a in "$@"; do [[ "$a" == "--dry-run" ]] && dry_run=1; done

WHEELS=(grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1
        grpcio-reflection==1.85.1 crc32c==2.9)
if [[ "${1:-}" == "--prepare" ]]; then
    py=${PYTHON:-python3}
    mkdir -p .whl
    for w in "${WHEELS[@]}"; do
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$w" \
            || echo "gpu_check: could not download $w" >&2
    done
    "$py" -c 'import sys; sys.path.insert(0, "scripts"); import gpu_check_serving as s; \
print("tokenizer:", s.tokenizer_dir())'
    exit $?
fi

# grpc & co. present and at pyproject's floors? (exit 1 when anything is missing or old)
deps_ok() { "$1" - <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
floors = {"grpcio": (1, 85, 1), "grpcio-health-checking": (1, 85, 1),
          "grpcio-reflection": (1, 85, 1), "protobuf": (7, 35, 1), "crc32c": (2, 4)}
for name, floor in floors.items():
    if tuple(int(x) for x in version(name).split(".")[:len(floor)]) < floor:
        sys.exit(1)
import grpc, grpc_health, grpc_reflection, crc32c, google.protobuf  # noqa
PY
}

has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1; }
has_module() { "$1" -c "import $2" >/dev/null 2>&1; }

py=""
torch_version=""  # known without another torch import once a dry run's probe has read it
candidates=("${PYTHON:-}" python3 .venv/bin/python)
for c in "${candidates[@]}"; do
    [[ -n "$c" ]] && command -v "$c" >/dev/null 2>&1 || continue
    if (( dry_run )); then
        # one process for both imports and the version (each torch import costs seconds)
        torch_version=$("$c" -c 'import torch, triton; print(torch.__version__)' 2>/dev/null) \
            && { py="$c"; break; }
    elif has_cuda_torch "$c"; then
        py="$c"; break
    fi
done

if [[ -z "$py" ]]; then
    if (( dry_run )); then
        echo "gpu_check: no python with torch and triton for the dry run" >&2; exit 1
    fi
    # No CUDA torch anywhere: build a venv that still sees system site-packages.
    echo "gpu_check: no python with a CUDA torch; creating .venv-gpu" >&2
    [[ -x .venv-gpu/bin/python ]] || python3 -m venv --system-site-packages .venv-gpu
    py=.venv-gpu/bin/python
    has_cuda_torch "$py" || "$py" -m pip install -q torch \
        || echo "gpu_check: pip install torch failed (offline?)" >&2
fi

if (( ! dry_run )); then
    # Only what is missing; each failure is left for the report's sections to record.
    for m in triton numpy pytest; do
        has_module "$py" "$m" || "$py" -m pip install -q "$m" \
            || echo "gpu_check: pip install $m failed (offline?)" >&2
    done
    if ! deps_ok "$py"; then
        if compgen -G ".whl/*.whl" >/dev/null; then
            site=${TMPDIR:-/tmp}/gpu_check_site
            "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" .whl/*.whl \
                && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
                || echo "gpu_check: installing .whl/ failed" >&2
        else
            echo "gpu_check: grpc/protobuf/crc32c missing or old and no .whl/ (run --prepare" \
                 "where a package registry is reachable); the e2e section will fail" >&2
        fi
    fi
    # Compiled, not interpreted: that is the point of this check. "0", not unset, because
    # the test modules default it to "1" for CPU runs.
    export TRITON_INTERPRET=0
fi

[[ -n "$torch_version" ]] || torch_version=$("$py" -c 'import torch; print(torch.__version__)' 2>&1)
echo "gpu_check: using $py ($torch_version)" >&2
exec "$py" scripts/gpu_check.py "$@"
