"""The elastic comparison's pure parts (pdserve.bench.elastic): the two-phase load, goodput
per phase, and the cluster it starts (role workers; the planner only when asked)."""

from __future__ import annotations

import math

from pdserve.bench import compare, elastic
from pdserve.bench.clients import RequestRecord
from pdserve.bench.runner import RunResult


class WordTokenizer:
    """One token per word: enough for `fit_text`."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join("x" * i for i in ids)


E = elastic.ElasticSettings(phase_s=20.0, prompt_len=40, prompt_phase_output=4,
                            prompt_rate=1.0, output_prompt_len=8, output_len=32,
                            output_rate=2.0)


def test_two_phase_load_shapes_and_arrivals():
    load = elastic.two_phase_load(E, WordTokenizer(), seed=3)
    first = [r for r in load if r.arrival_s < 20]
    second = [r for r in load if r.arrival_s >= 20]
    assert first and second and len(load) == len(first) + len(second)
    assert {(r.prompt_tokens, r.output_tokens) for r in first} == {(40, 4)}
    assert {(r.prompt_tokens, r.output_tokens) for r in second} == {(8, 32)}
    assert all(r.arrival_s < 40 for r in load)
    assert [r.request_id for r in load] == list(range(len(load)))
    assert [r.arrival_s for r in load] == sorted(r.arrival_s for r in load)
    # Poisson at 1 and 2 req/s over 20 s: about 20 and 40 requests
    assert 8 <= len(first) <= 30 and 24 <= len(second) <= 56
    assert load == elastic.two_phase_load(E, WordTokenizer(), seed=3)  # seeded


def _rec(i: int, arrival: float, ttft: float, tpot: float, n: int = 5,
         error: str | None = None) -> RequestRecord:
    return RequestRecord(request_id=i, prompt_tokens=8, expected_output_tokens=n,
                         arrival_s=arrival, send_time=100.0, first_token_time=100.0 + ttft,
                         end_time=100.0 + ttft + tpot * (n - 1), usage_output_tokens=n,
                         error=error)


def test_phase_goodput_counts_requests_meeting_both_slos_by_arrival_phase():
    records = [_rec(0, 1.0, 0.5, 0.05), _rec(1, 5.0, 3.0, 0.05),  # phase 1: TTFT miss
               _rec(2, 21.0, 0.5, 0.05), _rec(3, 22.0, 0.5, 0.5),  # phase 2: TPOT miss
               _rec(4, 30.0, 0.5, 0.05), _rec(5, 39.0, 0.1, 0.01, error="UNAVAILABLE")]
    result = RunResult("x", math.inf, report=None, records=records)
    rows = elastic.phase_goodput(result, E, ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert rows == {
        "long-prompt": {"requests": 2, "completed": 2, "met_slo": 1, "goodput": 1 / 20},
        "long-output": {"requests": 4, "completed": 3, "met_slo": 2, "goodput": 2 / 20},
        "all": {"requests": 6, "completed": 5, "met_slo": 3, "goodput": 3 / 40}}


def test_cluster_config_role_workers_and_planner_flags():
    fixed = elastic.cluster_config("m", ("--threads", "1"), False, 5.0, 0.25, E, "none")
    planned = elastic.cluster_config("m", ("--threads", "1"), True, 5.0, 0.25, E, "none")
    for c in (fixed, planned):
        assert dict(c.modules)["prefill"] == dict(c.modules)["decode"] == "pdserve.role_worker"
        assert (c.prefill_args, c.decode_args) == (("--role", "prefill"), ("--role", "decode"))
        assert (c.num_prefill, c.num_decode) == (1, 1)
    assert fixed.gateway_args == ()
    args = planned.gateway_args
    assert args[:2] == ("--planner", "slo")
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--ttft-slo"] == "5" and flags["--tpot-slo"] == "0.25"
    assert flags["--planner-min-prefill"] == "0"
    # the flags exist on the gateway's parser
    from pdserve.gateway.__main__ import build_parser
    a = build_parser().parse_args(["--model", "m", *args])
    assert (a.planner, a.planner_min_prefill, a.tpot_slo) == ("slo", 0, 0.25)


def test_compare_elastic_flags_and_default_selection():
    p = compare.build_parser()
    assert p.parse_args([]).only == ["disagg", "prefix", "offline"]
    a = p.parse_args(["--only", "elastic", "--phase-seconds", "30",
                      "--elastic-rates", "0.2", "0.5", "--elastic-lengths", "512", "128"])
    assert a.only == ["elastic"] and a.phase_seconds == 30 and a.elastic_rates == [0.2, 0.5]
    assert a.elastic_lengths == [512, 128]
