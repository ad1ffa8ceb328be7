"""Overlap scheduling (step N+1 scheduled and prepared while step N runs) against the engine
stepped in turn: the same tokens for greedy and seeded sampling, with requests joining and
leaving mid-run, stop tokens, max_tokens, aborts, preemption and KV arriving from another
worker mid-run; no placeholder ever reaches a client, and every pool ends clean. On the CPU
a launch finishes before it returns, so this runs the overlap code path synchronously."""

from __future__ import annotations

import argparse

import pytest
from conftest import assert_pool_clean, tiny_engine

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KVLayerCopy, KVSaver
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.overlap import PLACEHOLDER
from pdserve.protocol import SamplingParams


def _engine(model_dir: str, overlap: bool, static: bool = False, **kw):
    eng = tiny_engine(model_dir, max_num_seqs=12, overlap_scheduling="on" if overlap else "off",
                      **kw)
    if static:  # the persistent-buffer decode path (what CUDA replays as graphs), eagerly
        r = eng.runner
        eng.runner = ModelRunner(r.model, r.kv_cache, r.backend, r.eos_token_ids, 12,
                                 eng.max_model_len, static_decode=True)
    assert (eng.overlap is not None) == overlap
    return eng


def _params(i: int, **kw) -> SamplingParams:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9, top_p=0.9, seed=100 + i),
        dict(temperature=1.1, top_k=20, min_p=0.02, seed=200 + i, logprobs=2),
        dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
        dict(temperature=0.8, presence_penalty=1.0, seed=300 + i, logprobs=3),
        dict(temperature=0.7, seed=400 + i, min_tokens=3),
    ]
    kw.setdefault("ignore_eos", True)
    kw.setdefault("max_tokens", 3 + (5 * i) % 13)
    return SamplingParams(**kinds[i % len(kinds)], **kw)


def _prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 4000 + 30 for j in range(3 + 9 * (i % 4))]


class Run:
    """Drives an engine through a script of events keyed by step call, collecting deltas."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list] = {}
        self.finish: dict[str, str | None] = {}
        self.overlapped_calls = 0  # calls that left a step in flight with placeholders

    def collect(self, deltas) -> None:
        for d in deltas:
            assert PLACEHOLDER not in d.new_token_ids
            self.tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            self.logprobs.setdefault(d.request_id, []).extend(d.new_logprobs)
            if d.finished:
                assert d.request_id not in self.finish, "two final deltas"
                self.finish[d.request_id] = d.finish_reason

    def drive(self, events: dict[int, list]) -> Run:
        call = 0
        while self.eng.has_unfinished() or any(k >= call for k in events):
            for ev in events.get(call, []):
                self.collect([d for d in [ev(self.eng)] if d is not None])
            self.collect(self.eng.step())
            f = self.eng.overlap.inflight if self.eng.overlap else None
            self.overlapped_calls += bool(f and f.pending)
            call += 1
            assert call < 500, "the run does not end"
        return self


def _add(rid: str, i: int, **kw):
    return lambda eng: eng.add_request(rid, _prompt(i), _params(i, **kw)) and None


def _mixed_events(**kw) -> dict[int, list]:
    """Five requests at first, seven more joining every other call while others finish."""
    ev: dict[int, list] = {0: [_add(f"r{i}", i, **kw) for i in range(5)]}
    for j, i in enumerate(range(5, 12)):
        ev.setdefault(2 + 2 * j, []).append(_add(f"r{i}", i, **kw))
    return ev


def _same(a: Run, b: Run) -> None:
    assert a.tokens == b.tokens
    assert a.finish == b.finish
    for rid, want in b.logprobs.items():
        got = a.logprobs[rid]
        assert [x.token_id for x in got] == [x.token_id for x in want]
        for x, y in zip(got, want):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert abs(x.logprob - y.logprob) < 1e-4  # other batch shapes: other GEMM blocking


@pytest.mark.parametrize("static", [False, True], ids=["per-step", "static-buffers"])
def test_overlap_equals_in_turn_mixed_batch(tiny_model_dir, static):
    on = Run(_engine(tiny_model_dir, True, static)).drive(_mixed_events())
    off = Run(_engine(tiny_model_dir, False, static)).drive(_mixed_events())
    _same(on, off)
    assert len(off.tokens) == 12 and all(r == "length" for r in off.finish.values())
    assert any(on.logprobs.values())
    assert on.overlapped_calls > 5  # placeholders were fed through the device, not the host
    assert on.eng.overlap.inflight is None
    assert_pool_clean(on.eng)
    assert_pool_clean(off.eng)


def test_stop_tokens_and_min_tokens(tiny_model_dir):
    """Sequences that stop on a sampled token were already scheduled into the next step:
    that step's extra token is dropped and the output ends at the stop token."""
    free = Run(_engine(tiny_model_dir, False)).drive(_mixed_events(max_tokens=12))
    ev: dict[int, list] = {0: []}
    for i in range(8):
        out = free.tokens[f"r{i}"]
        stop = out[1 + i % 5]  # a token the request samples mid-run
        ev.setdefault(0 if i < 4 else 2 * i, []).append(_add(f"r{i}", i, max_tokens=12,
                                              stop_token_ids=[stop]))
    on = Run(_engine(tiny_model_dir, True)).drive(ev)
    off = Run(_engine(tiny_model_dir, False)).drive(ev)
    _same(on, off)
    stopped = [r for r, why in off.finish.items() if why == "stop"]
    assert len(stopped) >= 4, off.finish
    for rid in stopped:
        assert len(off.tokens[rid]) < 12
    assert_pool_clean(on.eng)
    assert_pool_clean(off.eng)


def test_aborts_mid_run(tiny_model_dir):
    """Aborted while their step is in flight: the stream ends once with "abort", the
    placeholder never shows, the others are unchanged, the pool ends clean."""
    def abort(rid):
        return lambda eng: eng.abort_request(rid)

    def events():
        ev = _mixed_events(max_tokens=14)
        for call, rid in [(3, "r1"), (4, "r3"), (6, "r0"), (9, "r6"), (10, "r99")]:
            ev.setdefault(call, []).append(abort(rid))
        return ev

    on = Run(_engine(tiny_model_dir, True)).drive(events())
    off = Run(_engine(tiny_model_dir, False)).drive(events())
    aborted = {"r0", "r1", "r3", "r6"}
    assert {r for r, why in on.finish.items() if why == "abort"} == aborted
    assert {r for r, why in off.finish.items() if why == "abort"} == aborted
    for rid in off.tokens:
        if rid in aborted:  # overlap publishes a step later: a prefix of the same tokens
            assert on.tokens[rid] == off.tokens[rid][:len(on.tokens[rid])]
        else:
            assert on.tokens[rid] == off.tokens[rid]
    assert_pool_clean(on.eng)
    assert_pool_clean(off.eng)


@pytest.mark.parametrize("static", [False, True], ids=["per-step", "static-buffers"])
def test_preemption_with_a_tiny_pool(tiny_model_dir, static):
    """Six 16-token blocks for twelve requests: sequences with a step in flight are
    preempted and recomputed with the token that step sampled."""
    on = Run(_engine(tiny_model_dir, True, static, num_kv_blocks=6)).drive(_mixed_events())
    off = Run(_engine(tiny_model_dir, False, static, num_kv_blocks=6)).drive(_mixed_events())
    _same(on, off)
    assert on.eng.scheduler.num_preemptions > 0 and off.eng.scheduler.num_preemptions > 0
    assert_pool_clean(on.eng)
    assert_pool_clean(off.eng)


class _ListSaver(KVSaver):
    def __init__(self) -> None:
        self.copies: list[KVLayerCopy] = []

    def save_layer(self, copy: KVLayerCopy) -> None:
        self.copies.append(copy)


@pytest.mark.parametrize("overlap_prefill", [False, True])
def test_disaggregated_kv_arriving_mid_run(tiny_model_dir, overlap_prefill):
    """A prefill engine saves two prompts' KV (prefill-only sequences: sure to finish, never
    scheduled a step ahead); a decode engine running a mixed batch reserves, receives and
    commits them mid-run. Overlap on and off agree, on both sides."""
    pre = _engine(tiny_model_dir, overlap_prefill, max_num_batched_tokens=20)  # chunked
    pushed = {}
    for rid, i in (("d0", 23), ("d1", 22)):
        saver = _ListSaver()
        pre.add_request(rid, _prompt(i), SamplingParams(max_tokens=1, temperature=0.0),
                        prefill_only=True, kv_saver=saver)
        pushed[rid] = (i, saver)
    first = Run(pre).drive({})
    assert set(first.finish) == {"d0", "d1"}
    assert_pool_clean(pre)

    def reserve(rid):
        i, _ = pushed[rid]
        return lambda eng: eng.kv_connector.reserve(rid, _prompt(i), _params(i)) and None

    def write(rid):
        def w(eng):
            for c in pushed[rid][1].copies:
                eng.kv_connector.write(rid, c.layer, c.block_indices, c.k[None], c.v[None])
        return w

    def commit(rid):
        return lambda eng: eng.kv_connector.commit(rid, first.tokens[rid][0])

    def events():
        ev = _mixed_events()
        for call, fn in [(1, reserve("d0")), (3, write("d0")), (3, reserve("d1")),
                         (4, commit("d0")), (6, write("d1")), (7, commit("d1"))]:
            ev.setdefault(call, []).append(fn)
        return ev

    on = Run(_engine(tiny_model_dir, True)).drive(events())
    off = Run(_engine(tiny_model_dir, False)).drive(events())
    _same(on, off)
    assert len(on.tokens["d0"]) == _params(23).max_tokens
    assert_pool_clean(on.eng)
    assert_pool_clean(off.eng)


def test_flag_and_auto():
    from pdserve.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args([]))
    assert cfg.overlap_scheduling == "auto" and not cfg.overlap_enabled  # CPU: off
    assert EngineConfig(device="cuda:0").overlap_enabled
    assert not EngineConfig(device="cuda", overlap_scheduling="off").overlap_enabled
    on = engine_config_from_args(p.parse_args(["--overlap-scheduling", "on"]))
    assert on.overlap_enabled
    with pytest.raises(ValueError, match="overlap_scheduling"):
        EngineConfig(overlap_scheduling="yes")
