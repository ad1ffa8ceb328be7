"""scripts/gpu_check.sh --dry-run on the CPU: every section imports and runs its code path
(kernels under the interpreter at tiny shapes; the static decode path eagerly; one small
colocated cluster driven by the load generator) and one JSON report with a verdict comes
out."""

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
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    sections = report["sections"]
    assert list(sections) == ["env", "kernel_tests", "decode_bandwidth", "prefill_tflops",
                              "fused_ops", "engine_throughput", "decode_step", "e2e"]
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
    step = sections["decode_step"]
    assert "error" not in step, step
    assert step["graphs"] is None  # capture is the CUDA-only piece
    assert step["batch3"]["ms_per_step"] > 0 and step["batch1"]["ms_per_step"] > 0
    parity = step["greedy_parity_graphs_vs_eager"]
    assert parity["first_mismatch_per_prompt"] == [parity["tokens_each"]] * 5
    e2e = sections["e2e"]["colocated"]
    assert "error" not in e2e, e2e
    assert e2e["fixed_32_8"]["completed"] == 4 and not e2e["fixed_32_8"]["errors"]
    rows = {r["figure"]: r["result"] for r in report["verdict"]}
    assert len(rows) == 13 and set(rows.values()) <= {"PASS", "FAIL", "MISSING"}
    assert rows["greedy parity, graphs vs --enforce-eager"] == "PASS"
