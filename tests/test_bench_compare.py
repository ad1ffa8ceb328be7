"""Smoke test of `pdserve.bench.compare`: the disaggregated-vs-colocated and prefix-caching
comparisons end to end on real local clusters with the tiny model (4 requests, one rate,
small prompts), checking the result structure and that the numbers are sane — not the
targets, which only the real model on a quiet machine can speak to."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import compare
from pdserve.cli import build_parser


def test_pdserve_bench_takes_loadgen_flags() -> None:
    from pdserve.bench import loadgen

    sub = build_parser()._subparsers._group_actions[0].choices
    assert "bench" in sub
    ours = {s for act in sub["bench"]._actions for s in act.option_strings}
    theirs = {s for act in loadgen.build_parser()._actions for s in act.option_strings}
    assert ours == theirs


def test_targets_and_only_parsing() -> None:
    assert compare.target("x", 0.4, "<=", 0.5)["met"]
    miss = compare.target("x", 0.6, "<=", 0.5)
    assert not miss["met"] and miss["result"] == "missed by 20%"
    assert compare.target("x", 1.5, "<=", 0.5)["result"] == "missed: 3.0x the bound"
    assert compare.target("y", 1.2, ">=", 1.5)["result"] == "missed by 20%"
    assert compare.target("y", None, ">=", 1.5)["result"] == "not measured"
    assert compare.build_parser().parse_args(["--only", "prefix,disagg"]).only == [
        "prefix", "disagg"]
    with pytest.raises(SystemExit):
        compare.build_parser().parse_args(["--only", "nope"])


def test_scrape_sums_label_sets(monkeypatch) -> None:
    page = (b"# HELP pdserve:prompt_tokens_total x\n"
            b'pdserve:prompt_tokens_total{model_name="m",tier="decode",worker="a"} 10.0\n'
            b'pdserve:prompt_tokens_total{model_name="m",tier="decode",worker="b"} 5.0\n'
            b'pdserve:prompt_tokens_created{worker="a"} 1.7e9\n')

    class Resp:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return page

    monkeypatch.setattr(compare.urllib.request, "urlopen", lambda url, timeout: Resp())
    assert compare.scrape("http://x/metrics") == {
        "pdserve:prompt_tokens_total": 15.0, "pdserve:prefix_cache_hits_total": 0.0}


@pytest.mark.timeout(240)
def test_disagg_and_prefix_smoke(tiny_model_dir, tmp_path) -> None:
    s = compare.Settings(
        model=tiny_model_dir, disagg_requests=4, disagg_rates=(4.0,), prefix_requests=4,
        prefix_rate=2.0, drain_s=60.0, kv_cache_memory="64MiB", startup_timeout_s=120.0,
        long_prompt_params={"long_fraction": 0.5, "long_range": (96, 160),
                            "short_range": (8, 24), "output_range": (4, 8)},
        shared_prefix_params={"system_len": 64, "question_range": (8, 16),
                              "output_range": (4, 8), "max_turns": 2},
        conditional_threshold=64, progress=False, command="pytest")
    merged = compare.run(s, ["disagg", "prefix"], tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())["comparisons"]
    assert set(saved) == {"disagg", "prefix"} and saved == json.loads(json.dumps(merged))

    d = saved["disagg"]
    assert d["rates"] == [4.0] and d["compared_at_rate"] == 4.0
    (row,) = d["rows"]
    assert set(row) == {"rate", "disaggregated", "colocated", "conditional"}
    for label in ("disaggregated", "colocated", "conditional"):
        r = row[label]
        assert r["completed"] == r["num_requests"] == 4 and r["sustained"], r
        assert r["tpot_ms_p99"] > 0 and r["goodput"] > 0 and r["slo_attainment"] == 1.0
    assert d["p99_tpot_ratio"] > 0 and d["goodput_ratio"] > 0
    assert [t["target"] for t in d["targets"]] == ["<= 0.5", ">= 1.5"] * 2
    assert [t["metric"] for t in d["targets"]][2:] == [
        "P99 TPOT, conditional / colocated", "goodput, conditional / colocated"]
    assert all(t["measured"] is not None for t in d["targets"])
    # the TPOT-SLO grid re-scores the same requests: it agrees with the main score at the
    # configured SLO, and attainment can only grow as the SLO loosens
    grid = d["tpot_slo_sensitivity"]
    assert [e["tpot_slo_ms"] for e in grid] == list(compare.TPOT_SLO_GRID_MS)
    for label in ("disaggregated", "colocated", "conditional"):
        att = [e[label]["attainment"][0] for e in grid]
        assert att == sorted(att)
        at_cfg = next(e for e in grid if e["tpot_slo_ms"] == d["slo_ms"]["tpot"])
        assert at_cfg[label]["attainment"] == [row[label]["slo_attainment"]]
    assert "scored under other TPOT SLOs" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "disagg" / "runs.json").exists()
    assert (tmp_path / "disagg" / "latency_cdf.png").stat().st_size > 0

    p = saved["prefix"]
    on, off = p["results"]["caching on"], p["results"]["caching off"]
    assert on["completed"] == off["completed"] == 4
    assert on["prompt_tokens"] == off["prompt_tokens"] > 0  # same requests, all counted
    assert on["prefix_cache_hits"] > 0 and off["prefix_cache_hits"] == 0
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert p["ttft_p50_ratio"] > 0 and p["prefill_tokens_ratio"] > 1

    md = (tmp_path / "results.md").read_text()
    assert "## Disaggregated vs colocated" in md and "## Prefix caching on vs off" in md
    assert md.count("Command: `pytest`") == 2
    assert "missed by" in md or "| met |" in md
