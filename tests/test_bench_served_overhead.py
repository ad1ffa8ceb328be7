"""`python -m pdserve.bench.served_overhead`'s sampling flag: both sides of the comparison
sample with what it parses (the runs themselves are benchmarks, outside the suite)."""

from __future__ import annotations

import pytest

from pdserve.bench.served_overhead import build_parser
from pdserve.protocol import SamplingParams


def test_greedy_unless_told():
    assert build_parser().parse_args([]).sampling == {"temperature": 0.0}


def test_sampling_fields_parse_into_valid_params():
    a = build_parser().parse_args(["--sampling", "temperature=1.0,top_p=0.95,top_k=40"])
    assert a.sampling == {"temperature": 1.0, "top_p": 0.95, "top_k": 40}
    assert isinstance(a.sampling["top_k"], int)
    assert not SamplingParams(max_tokens=8, **a.sampling).greedy
    a = build_parser().parse_args(["--sampling", "temperature=0,repetition_penalty=1.1,"
                                   "presence_penalty=0.5,frequency_penalty=0.3"])
    params = SamplingParams(max_tokens=8, **a.sampling)
    assert params.greedy and params.repetition_penalty == 1.1 and params.frequency_penalty == 0.3


@pytest.mark.parametrize("value,message", [
    ("top_q=3", "KEY one of temperature, top_p, top_k, min_p"),
    ("temperature", "KEY=VALUE"),
    ("top_k=0.5", "is not a number"),
])
def test_a_bad_field_is_refused_naming_it(value, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--sampling", value])
    assert message in capsys.readouterr().err
