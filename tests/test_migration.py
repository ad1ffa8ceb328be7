"""Migration's parts without a network: a request re-admitted from prompt + tokens already
generated (`migration.resumed`, `SamplingParams.output_offset`) continues exactly where it
stopped in the real engine — greedy, seeded sampling and output penalties — and the policy
picks the next worker as its docstring says."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from conftest import assert_pool_clean, tiny_engine

from pdserve.gateway import migration
from pdserve.gateway.errors import ErrorKind, GatewayError
from pdserve.gateway.registry import Load, Role, Worker
from pdserve.gateway.request import GenerationRequest
from pdserve.protocol import SamplingParams

PROMPT = [1, 17, 230, 4051, 99, 12, 7, 801, 3300, 45]


def _resume_in_engine(engine, params: SamplingParams, cut: int) -> tuple[list[int], list[int]]:
    """The whole output in one go, and the output of the first `cut` tokens followed by the
    rest from a request re-admitted the way the gateway does it."""
    whole = engine.generate([PROMPT], params)[0].token_ids
    req = GenerationRequest("client-1", tuple(PROMPT), params)
    again = migration.resumed(req, whole[:cut], attempt=1)
    assert again.cluster_id != req.cluster_id
    # the params cross the wire to the worker: through the proto, as they would
    wire = SamplingParams.from_proto(again.params.to_proto())
    rest = engine.generate([list(again.prompt_token_ids)], wire)[0].token_ids
    return list(whole), list(whole[:cut]) + list(rest)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=3, presence_penalty=1.5,
                   frequency_penalty=1.0, ignore_eos=True),
], ids=["greedy", "seeded", "seeded+penalties"])
def test_resumed_request_continues_the_same_output(tiny_model_dir, params):
    engine = tiny_engine(tiny_model_dir, num_threads=1)
    for cut in (1, 5, 11):
        whole, resumed = _resume_in_engine(engine, params, cut)
        assert resumed == whole, f"cut at {cut}"
    assert_pool_clean(engine)


def test_without_the_offset_a_seeded_request_would_diverge(tiny_model_dir):
    """The offset is what makes the seeded case above hold: the control experiment."""
    engine = tiny_engine(tiny_model_dir, num_threads=1)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    whole = engine.generate([PROMPT], params)[0].token_ids
    cut = 4
    naive = dataclasses.replace(params, max_tokens=12 - cut)
    rest = engine.generate([PROMPT + list(whole[:cut])], naive)[0].token_ids
    assert list(whole[cut:]) != list(rest)


def test_resumed_limits_and_ids():
    p = SamplingParams(max_tokens=10, min_tokens=6, temperature=0)
    req = GenerationRequest("c", (5, 6, 7), p, cluster_id="abc")
    r = migration.resumed(req, [8, 9, 10, 11], attempt=2)
    assert r.prompt_token_ids == (5, 6, 7, 8, 9, 10, 11)
    assert (r.params.max_tokens, r.params.min_tokens, r.params.output_offset) == (6, 2, 4)
    assert r.cluster_id == "abc-m2" and r.request_id == "c"
    twice = migration.resumed(r, [12], attempt=3)
    assert twice.params.output_offset == 5  # offsets add up across moves
    assert migration.resumed(req, [], attempt=1).prompt_token_ids == req.prompt_token_ids
    with pytest.raises(ValueError, match="output_offset"):
        SamplingParams(output_offset=-1)


def _worker(wid: str) -> Worker:
    return Worker(wid, Role.DECODE, f"127.0.0.1:{len(wid)}", "m", None,
                  Load(0, 0, 10, 10, 0.0, 0, frozenset()), 0.0)


def test_policy_prefers_fresh_workers_and_never_retries_an_engine_failure():
    a, b = _worker("a"), _worker("b")
    assert migration.candidates([a, b], {"a": ErrorKind.UNAVAILABLE}) == ([b], False)
    assert migration.candidates([a, b], {"a": ErrorKind.UNAVAILABLE,
                                         "b": ErrorKind.UNAVAILABLE}) == ([a, b], True)
    assert migration.candidates([a], {"a": ErrorKind.INTERNAL}) == ([], True)
    assert migration.may_migrate(GatewayError(ErrorKind.UNAVAILABLE, "x"), 0)
    assert migration.may_migrate(GatewayError(ErrorKind.INTERNAL, "x"), 0)
    assert not migration.may_migrate(GatewayError(ErrorKind.INVALID, "x"), 3)
    assert not migration.may_migrate(GatewayError(ErrorKind.DEADLINE, "x"), 3)
    assert not migration.may_migrate(GatewayError(ErrorKind.OVERLOADED, "x"), 0)
    assert migration.may_migrate(GatewayError(ErrorKind.OVERLOADED, "x"), 2)
    assert migration.prefill_may_fail_over(grpc.StatusCode.UNAVAILABLE)
    assert migration.prefill_may_fail_over(grpc.StatusCode.INTERNAL)
    assert not migration.prefill_may_fail_over(grpc.StatusCode.INVALID_ARGUMENT)
