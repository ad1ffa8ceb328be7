#!/usr/bin/env bash
# One prepared GPU check (scripts/gpu_check.py): compiles and measures the Triton kernels and
# the engine on an NVIDIA GPU and writes ONE JSON report in under 8 minutes.
#
#   scripts/gpu_check.sh [--out PATH] [--only a,b] [--dry-run]
#
# Report: --out, else $OUT/gpu_report.json when $OUT is set, else ./gpu_report.json.
# Python: $PYTHON if set, else the first of python3 / .venv/bin/python whose torch sees a
# GPU; failing that a venv (.venv-gpu, inheriting system packages) with what is missing
# pip-installed. --dry-run (CPU) only needs a python with torch and triton.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
for a in "$@"; do [[ "$a" == "--dry-run" ]] && dry_run=1; done

has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1; }
has_module() { "$1" -c "import $2" >/dev/null 2>&1; }

py=""
candidates=("${PYTHON:-}" python3 .venv/bin/python)
for c in "${candidates[@]}"; do
    [[ -n "$c" ]] && command -v "$c" >/dev/null 2>&1 || continue
    if (( dry_run )); then
        has_module "$c" torch && has_module "$c" triton && { py="$c"; break; }
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
    # Compiled, not interpreted: that is the point of this check. "0", not unset, because
    # the test modules default it to "1" for CPU runs.
    export TRITON_INTERPRET=0
fi

echo "gpu_check: using $py ($("$py" -c 'import torch; print(torch.__version__)' 2>&1))" >&2
exec "$py" scripts/gpu_check.py "$@"
