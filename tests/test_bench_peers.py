"""The peers harness without its peers: argument parsing, the command line each system is
started with, the table rendered from a recorded result, and the one-line refusal when a
peer is not built. Nothing here builds, downloads or starts anything."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench import peers
from pdserve.bench.metrics import BenchReport, LatencyStats
from pdserve.bench.peers_build import PeerPaths
from pdserve.bench.peers_host import descendants, rss_bytes
from pdserve.bench.peers_report import render_markdown, table
from pdserve.bench.peers_run import NotBuilt, check_built
from pdserve.bench.peers_systems import DEFAULT_SYSTEMS, SYSTEMS, launch, reset_requests
from pdserve.bench.peers_workloads import WORKLOADS

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- arguments


def test_help_runs_for_every_command(capsys):
    for argv in ([], ["build"], ["run"]):
        with pytest.raises(SystemExit) as exc:
            peers.main([*argv, "--help"])
        assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--only LIST" in out and "--systems LIST" in out and "--workloads LIST" in out
    assert ",".join(DEFAULT_SYSTEMS) in out.replace("\n", "").replace(" ", "")


def test_defaults_and_subsets():
    p = peers.build_parser()
    a = p.parse_args(["run"])
    assert a.systems == list(DEFAULT_SYSTEMS) and "llamacpp-f32" not in a.systems
    assert a.workloads == ["a", "b", "c", "d"]
    assert a.out_dir == Path("docs/bench/peers")
    a = p.parse_args(["run", "--systems", "llamacpp-f16,vllm-fp32,llamacpp-f16",
                      "--workloads", "d"])
    assert a.systems == ["llamacpp-f16", "vllm-fp32"]  # run order kept, repeats dropped
    assert a.workloads == ["d"]
    assert p.parse_args(["build", "--only", "llamacpp"]).only == ["llamacpp"]
    assert p.parse_args(["build"]).only == ["hf", "vllm", "llamacpp"]


@pytest.mark.parametrize("argv", [["run", "--systems", "vllm-fp16"],
                                  ["run", "--workloads", "e"],
                                  ["build", "--only", "torch"], ["run", "--systems", ""]])
def test_unknown_names_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        peers.main(argv)
    assert exc.value.code == 2
    assert "choose from" in capsys.readouterr().err


def test_workloads_match_peers_md():
    a, b, c, d = (WORKLOADS[k] for k in "abcd")
    assert (a.generator, a.num_requests, a.rate) == ("mixed", 64, math.inf)
    assert (b.generator, b.num_requests, dict(b.params)) == (
        "fixed", 32, {"input_len": 256, "output_len": 128})
    assert (c.generator, c.num_requests, c.rate, c.ttft_slo_s, c.tpot_slo_s) == (
        "mixed", 64, 2.0, 2.0, 0.2)
    assert (d.num_requests, dict(d.params)) == (1, {"input_len": 128, "output_len": 128})


def test_workload_requests_are_the_seeded_ones(smollm2_tokenizer):
    """The exact token totals with the real SmolLM2 tokenizer: every system gets these."""
    tok = smollm2_tokenizer
    reqs = {k: w.requests(tok, 0) for k, w in WORKLOADS.items()}
    totals = {k: (len(r), sum(x.prompt_tokens for x in r), sum(x.output_tokens for x in r))
              for k, r in reqs.items()}
    assert totals == {"a": (64, 11326, 5846), "b": (32, 8192, 4096), "c": (64, 11326, 5846),
                      "d": (1, 128, 128)}
    assert [r.prompt for r in reqs["a"]] == [r.prompt for r in reqs["c"]]  # shared prompts
    assert all(r.arrival_s == 0 for k in "abd" for r in reqs[k])
    assert 25 < reqs["c"][-1].arrival_s < 40  # 63 Poisson gaps at 2 req/s


# ---------------------------------------------------------------------------- command lines


def test_pdserve_starts_through_pdserve_up(tmp_path):
    paths = PeerPaths(tmp_path)
    for name, dtype in (("pdserve-fp32", "float32"), ("pdserve-bf16", "bfloat16")):
        la = launch(SYSTEMS[name], paths, 8123)
        assert la.argv == (sys.executable, "-m", "pdserve.cli", "up", "--http-port", "8123",
                           "--grpc-port", "0", "--dtype", dtype)
        assert la.env == {} and la.cwd == str(REPO)  # this checkout is the one imported
        assert la.health_url == "http://127.0.0.1:8123/health"
        assert reset_requests(SYSTEMS[name], la.base_url) == []
        assert SYSTEMS[name].reset == "restart"
    extra = ("--max-num-batched-tokens", "512")
    assert launch(SYSTEMS["pdserve-fp32"], paths, 8123, extra).argv[-2:] == extra
    assert "--max-num-batched-tokens" not in launch(SYSTEMS["vllm-fp32"], paths, 8123,
                                                    extra).argv


def test_vllm_command_and_tuned_env(tmp_path):
    paths = PeerPaths(tmp_path)
    la = launch(SYSTEMS["vllm-bf16"], paths, 9000)
    assert la.argv == (str(tmp_path / "venv/bin/python"), "-m",
                       "vllm.entrypoints.openai.api_server", "--model", str(tmp_path / "hf"),
                       "--served-model-name", "smollm2-135m", "--dtype", "bfloat16",
                       "--host", "127.0.0.1", "--port", "9000")
    cores = sorted(os.sched_getaffinity(0))[:2]
    bind = f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    assert la.env == {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "4",
                      "VLLM_SERVER_DEV_MODE": "1",
                      "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}  # nothing to preload
    for lib in (paths.tcmalloc, paths.iomp):
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.touch()
    la = launch(SYSTEMS["vllm-fp32"], paths, 9000)
    assert "float32" in la.argv
    assert la.env["LD_PRELOAD"] == f"{paths.tcmalloc}:{paths.iomp}"
    assert reset_requests(SYSTEMS["vllm-fp32"], la.base_url) == [
        "http://127.0.0.1:9000/reset_prefix_cache"]


def test_llama_server_command(tmp_path):
    paths = PeerPaths(tmp_path)
    src = tmp_path / "llama-cpp-python-0.3.1" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    for name, gguf in (("llamacpp-f16", "smollm2-135m-f16.gguf"),
                       ("llamacpp-f32", "smollm2-135m-f32.gguf")):
        la = launch(SYSTEMS[name], paths, 9100)
        assert la.argv == (str(src / "build/bin/llama-server"), "-m",
                           str(tmp_path / "gguf" / gguf), "-t", "2", "-np", "16", "-c",
                           "16384", "--host", "127.0.0.1", "--port", "9100")
    # its slot erase would keep the host-memory prompt cache: restarted instead
    assert reset_requests(SYSTEMS["llamacpp-f16"], la.base_url) == []
    assert SYSTEMS["llamacpp-f16"].reset == "restart"


# ---------------------------------------------------------------------------- not built


def test_run_refuses_unbuilt_peer_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_PEERS_DIR", str(tmp_path / "peers"))
    for system, step in (("vllm-fp32", "vllm"), ("llamacpp-f16", "llamacpp")):
        rc = peers.main(["run", "--systems", f"pdserve-fp32,{system}",
                         "--out-dir", str(tmp_path / "out")])
        captured = capsys.readouterr()
        assert rc == 2 and captured.out == ""
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1, captured.err
        assert lines[0].startswith(f"python -m pdserve.bench.peers run: {system} is not built")
        assert lines[0].endswith(f"`python -m pdserve.bench.peers build --only {step}`")
    assert not (tmp_path / "out").exists()  # refused before anything started or was written


def test_check_built_accepts_what_is_there(tmp_path):
    paths = PeerPaths(tmp_path)
    check_built(paths, ("pdserve-fp32", "pdserve-bf16"))  # pdserve needs nothing built
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(NotBuilt, match="venv/.vllm-installed"):
        check_built(paths, ("vllm-fp32",))
    paths.venv.mkdir()
    paths.vllm_stamp.touch()
    check_built(paths, ("vllm-fp32", "vllm-bf16"))
    with pytest.raises(NotBuilt, match="llamacpp-f32 is not built"):
        check_built(paths, ("vllm-fp32", "llamacpp-f32"))


# ---------------------------------------------------------------------------- rendering


def _stats(p50: float, p95: float) -> LatencyStats:
    return LatencyStats(10, p50, p50, p95, p95)


def _report(out_tps: float, duration: float, ttft=(100.0, 200.0), tpot=(10.0, 20.0),
            failed: int = 0, short: int = 0, attainment: float = 1.0) -> dict:
    return BenchReport(
        label="", rate=None, num_requests=64, completed=64 - failed, failed=failed,
        short_outputs=short, duration_s=duration, request_throughput=1.0,
        output_throughput=out_tps, total_token_throughput=2 * out_tps, ttft_slo_ms=None,
        tpot_slo_ms=None, goodput=1.0, slo_attainment=attainment, ttft_ms=_stats(*ttft),
        tpot_ms=_stats(*tpot), itl_ms=_stats(9.0, 30.0), e2e_ms=_stats(1.0, 2.0),
        errors={}).to_dict()


def _system(name: str, kind: str, workloads: dict, **extra) -> dict:
    return {"system": {"name": name, "kind": kind, "dtype": "x"},
            "guard": {"quiet": True, "waited_s": 3.0, "foreign_cpu_pct": 1.2,
                      "loadavg": [0.31, 0.5, 0.6]},
            "workloads": {k: {"report": r, "prefix_cache": "fresh start"}
                          for k, r in workloads.items()},
            "startup_s": [12.3], "peak_rss_bytes": 3 * 2**30 // 2, "error": None,
            "command": f"{name} --serve", "env": {}, **extra}


RECORDED = {
    "command": "python -m pdserve.bench.peers run", "seed": 0, "machine": "box (2 cores)",
    "workloads": {"d": {"title": "single 128/128", "ttft_slo_s": None, "tpot_slo_s": None}},
    "systems": {
        "pdserve-bf16": _system("pdserve-bf16", "pdserve", {
            "a": _report(189.0, 30.93, ttft=(6335.4, 12389.0), tpot=(263.0, 711.2)),
            "c": _report(80.0, 40.0, attainment=0.625),
            "d": _report(10.0, 2.0, ttft=(127.0, 127.0), tpot=(25.71, 25.71))}),
        "vllm-fp32": _system("vllm-fp32", "vllm", {
            "a": _report(94.5, 35.3, failed=2, short=1),
            "b": _report(179.2, 20.0)}, env={"VLLM_CPU_KVCACHE_SPACE": "4", "X": "y"}),
        "llamacpp-f16": _system("llamacpp-f16", "llamacpp", {}, startup_s=[],
                                peak_rss_bytes=0, error="llamacpp-f16 exited with 1"),
    },
}


def test_table_rows_and_ratios_from_a_recorded_result():
    lines = table(RECORDED["systems"])
    assert lines[0] == "| metric | pdserve-bf16 | vllm-fp32 | llamacpp-f16 |"
    assert lines[1] == "|---|---|---|---|"
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:]}
    assert rows["a out tok/s (wall s)"] == "| a out tok/s (wall s) | 189 (30.9) | 94.5 (35.3) | — |"
    assert rows["a TTFT p50/p95 (ms)"] == "| a TTFT p50/p95 (ms) | 6,335/12,389 | 100/200 | — |"
    assert rows["a TPOT p50/p95 (ms)"] == "| a TPOT p50/p95 (ms) | 263/711 | 10.0/20.0 | — |"
    assert rows["b out tok/s"] == "| b out tok/s | — | 179 | — |"
    assert rows["c SLO attainment"] == "| c SLO attainment | 0.625 | — | — |"
    assert rows["d TTFT / TPOT (ms)"] == "| d TTFT / TPOT (ms) | 127 / 25.7 | — | — |"
    assert rows["lost requests (failed/sent)"] == (
        "| lost requests (failed/sent) | a 0/64, c 0/64, d 0/64 | a 2/64 (1 short), b 0/64 | — |")
    assert rows["peak RSS (process tree)"] == (
        "| peak RSS (process tree) | 1.50 GiB | 1.50 GiB | — |")
    assert rows["CPU guard: foreign CPU / load avg"].endswith("| 1% / 0.31 | 1% / 0.31 "
                                                              "| 1% / 0.31 |")
    # one ratio row per pdserve system: its workload-a throughput over each column's
    assert rows["a out tok/s: pdserve-bf16 / this"] == (
        "| a out tok/s: pdserve-bf16 / this | 1.00 | 2.00 | — |")
    assert not any("vllm-fp32 / this" in line for line in lines)


def test_markdown_names_commands_and_errors():
    md = render_markdown(RECORDED)
    assert md.startswith("# pdserve beside vLLM (CPU) and llama.cpp\n")
    assert "Workloads: d = single 128/128." in md
    assert ("- **vllm-fp32**: `VLLM_CPU_KVCACHE_SPACE=4 X=y vllm-fp32 --serve`. Prefix cache "
            "per workload: a: fresh start") in md
    assert "- **pdserve-bf16**: `pdserve-bf16 --serve`." in md
    assert "**Error:** llamacpp-f16 exited with 1." in md


# ---------------------------------------------------------------------------- host


def test_process_tree_and_its_rss():
    child = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        # measured once the interpreter runs: right after the fork its RSS is ~200 KB
        assert child.stdout.readline() == b"1\n"
        tree = descendants(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        assert rss_bytes([child.pid]) > 1 << 20  # a Python interpreter: megabytes
        assert rss_bytes([child.pid, os.getpid()]) > rss_bytes([child.pid])
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert rss_bytes([child.pid]) == 0  # gone: nothing counted


def test_hf_step_saves_the_default_model_as_a_plain_llama_directory(tmp_path):
    # the directory both peers load: transformers' whole config (not the engine's few
    # fields), no "gguf" quantization left in it, float32 weights equal to the engine's
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from pdserve.bench.peers_build import build_hf
    from pdserve.engine.model_files import DEFAULT_MODEL, resolve_model
    from pdserve.engine.model_loader import load_hf_weights

    paths = PeerPaths(tmp_path)
    build_hf(paths)
    cfg = AutoConfig.from_pretrained(paths.hf_dir)
    assert cfg.model_type == "llama" and getattr(cfg, "quantization_config", None) is None
    assert (paths.hf_dir / "tokenizer.json").exists()
    saved = load_file(paths.hf_dir / "model.safetensors")
    _, state = load_hf_weights(resolve_model(DEFAULT_MODEL), show_progress=False)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert saved[name].dtype == torch.float32 and torch.equal(saved[name], state[name])
    build_hf(paths)  # idempotent: it exists, so nothing is rebuilt
