"""`python -m pdserve.bench.served_overhead`'s flags: both sides of the comparison sample with
what --sampling parses, and the layout follows the cores --cpus names (the runs themselves
are benchmarks, outside the suite)."""

from __future__ import annotations

import pytest

from pdserve.bench.served_overhead import _layout, build_parser
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


def test_the_layout_is_chosen_for_the_cores_cpus_names():
    assert build_parser().parse_args([]).cpus == "auto"
    two = _layout(build_parser().parse_args(["--cpus", "decode=0,gateway=1"]))
    assert (two.num_prefill, two.num_decode) == (0, 1)  # colocated below four cores
    four = _layout(build_parser().parse_args(["--cpus", "prefill=0,decode=1-2,gateway=3"]))
    assert (four.num_prefill, four.num_decode) == (1, 1)
    asked = _layout(build_parser().parse_args(["--cpus", "prefill=0,decode=1-2,gateway=3",
                                               "--layout", "colocated"]))
    assert (asked.num_prefill, asked.num_decode) == (0, 1)
