"""scripts/gpu_check.sh --dry-run on the CPU: every section imports and runs its code path
(kernels under the interpreter at tiny shapes) and one JSON report comes out."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run",
                           "--out", str(out)], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    sections = report["sections"]
    assert list(sections) == ["env", "kernel_tests", "decode_bandwidth", "prefill_tflops",
                              "fused_ops", "engine_throughput"]
    assert "triton" in sections["env"]["backends"]
    assert sections["kernel_tests"]["returncode"] == 0
    assert sections["kernel_tests"]["collected"] > 0
    for name in ("decode_bandwidth", "prefill_tflops", "fused_ops"):
        points = {k: v for k, v in sections[name].items() if k != "wall_s"}
        assert points and all("error" not in p for p in points.values()), points
    fused = sections["fused_ops"]
    assert {"add_rms_norm_tiny_T4_float32", "rope_tiny_T4_float32"} <= set(fused)
    assert "error" not in fused["rope_tiny_T4_float32"]["torch_compile"]  # dynamo traced it
    engine = sections["engine_throughput"]
    assert engine.get("engine_importable") is True, engine.get("error")
