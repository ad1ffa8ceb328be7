"""pdserve.protocol: the one validator (each field's error names the field), the finish-reason
map, proto round trips (max_tokens absent from what a prefill worker gets), and the
gateway's pre-parse checks on HTTP bodies. Pure Python: no model, no network."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pdserve.gateway.errors import GatewayError
from pdserve.gateway.openai_protocol import decode_body, json_depth
from pdserve.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_TIMEOUT_S,
    ProtocolError,
    SamplingParams,
    cdiv,
    check_priority,
    check_timeout,
    finish_from_proto,
    finish_to_proto,
    proto_fields,
    sampling_proto,
)
from pdserve.protos.pdserve.v1 import common_pb2


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2**31), ("max_tokens", 2.5),
    ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 2**31), ("top_k", 2**32), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5), ("presence_penalty", math.nan),
    ("frequency_penalty", -2.5), ("frequency_penalty", -math.inf),
    ("logprobs", -1), ("logprobs", 21),
    ("seed", -1), ("seed", 2**63),
    ("min_tokens", -1), ("min_tokens", 17),  # > max_tokens (16 below)
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**32]), ("stop_token_ids", "12"),
    ("ignore_eos", 1),
])
def test_each_bad_value_names_its_field(field, value):
    kw = {"max_tokens": 16, field: value}
    with pytest.raises(ProtocolError) as e:
        SamplingParams.from_fields(kw)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")


def test_defaults_once_and_top_k_zero_means_off():
    p = SamplingParams()
    assert p.max_tokens == DEFAULT_MAX_TOKENS and p.top_k == -1 and not p.greedy
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams.from_fields({"temperature": None, "top_k": 1}).greedy
    with pytest.raises(ProtocolError) as e:
        SamplingParams.from_fields({"best_of": 2})
    assert e.value.field == "best_of"


def test_proto_round_trip_and_max_tokens_sent_once():
    p = SamplingParams(max_tokens=40, temperature=0.5, top_k=7, seed=3, logprobs=2,
                       stop_token_ids=[5, 6], min_tokens=4)
    assert SamplingParams.from_proto(p.to_proto()) == p
    to_prefill = p.to_proto(with_max_tokens=False)
    assert not to_prefill.HasField("max_tokens")
    first = SamplingParams.from_proto(to_prefill, first_token_only=True)
    assert (first.max_tokens, first.min_tokens, first.temperature) == (1, 1, 0.5)
    # an unset optional field is the default, not zero
    assert SamplingParams.from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert proto_fields(sampling_proto(top_p=0.5))["temperature"] is None


def test_proto_values_the_wire_allows_but_we_do_not():
    m = common_pb2.SamplingParams(temperature=math.nan)
    with pytest.raises(ProtocolError) as e:
        SamplingParams.from_proto(m)
    assert e.value.field == "temperature"
    with pytest.raises(ProtocolError) as e:
        SamplingParams.from_proto(common_pb2.SamplingParams(top_k=2**32 - 1))
    assert e.value.field == "top_k"


def test_finish_reasons_one_map():
    for name in ("stop", "length", "abort"):
        assert finish_from_proto(finish_to_proto(name)) == name
    assert finish_to_proto(None) == common_pb2.FINISH_REASON_UNSPECIFIED
    assert finish_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) is None


def test_timeout_priority_and_cdiv():
    assert check_timeout(None) is None and check_timeout(2) == 2.0
    for bad in (0, -1, 1e10, MAX_TIMEOUT_S * 2, math.nan, math.inf, "5"):
        with pytest.raises(ProtocolError) as e:
            check_timeout(bad)
        assert e.value.field == "timeout"
    assert check_priority(-5) == -5
    for bad in (2**40, 1.0, True):
        with pytest.raises(ProtocolError):
            check_priority(bad)
    assert [cdiv(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_body_checks_before_and_after_parsing():
    assert json_depth(b'{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert json_depth(b'{"s": "\\"[[[["}') == 1
    with pytest.raises(GatewayError) as e:
        decode_body(b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert e.value.param == "body" and e.value.kind.http_status == 400
    with pytest.raises(GatewayError) as e:
        decode_body(b'{"prompt": "ok \\ud800 no"}')
    assert e.value.param == "prompt"
    with pytest.raises(GatewayError) as e:
        decode_body(b'{"messages": [{"role": "user", "content": "\\udfff"}]}')
    assert e.value.param == "messages" and "messages[0].content" in e.value.message
    assert decode_body(json.dumps({"prompt": "caf\u00e9 \U0001F600"}).encode())["prompt"]


def test_gateway_modules_import_without_torch():
    code = ("import sys\n"
            "import pdserve.gateway.server, pdserve.gateway.__main__, pdserve.client\n"
            "import pdserve.protocol, pdserve.convert, pdserve.engine.kv_spec\n"
            "import pdserve.engine.model_files, pdserve.engine.detokenizer\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert not any(m.startswith('transformers') for m in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
