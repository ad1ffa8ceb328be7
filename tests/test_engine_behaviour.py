"""Engine behaviour on the tiny model: prefix caching, continuous batching, preemption,
sampling rules and validation — each against exact expectations."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_pool_clean, hf_greedy, tiny_engine

from pdserve.engine.config import EngineConfig
from pdserve.protocol import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def test_prefix_cache_reuses_shared_blocks(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir, block_size=16)
    shared = [(5 * j) % 3000 + 100 for j in range(48)]  # exactly 3 full blocks
    a = shared + [7, 8, 9, 10, 11]
    b = shared + [21, 22, 23]
    first = eng.generate([a], GREEDY)[0].token_ids
    hits_before = eng.pool.prefix_hits
    eng.trace = []
    second = eng.generate([b], GREEDY)[0]
    assert eng.pool.prefix_hits - hits_before == 48  # the three shared blocks
    # only the 3 new prompt tokens were computed in the prefill step
    assert eng.trace[0].scheduled == ((second.request_id, 3),)
    fresh = tiny_engine(tiny_model_dir, enable_prefix_caching=False)
    assert second.token_ids == fresh.generate([b], GREEDY)[0].token_ids
    # and the first prompt again: all but its last partial block hit
    again = eng.generate([a], GREEDY)[0].token_ids
    assert again == first
    assert_pool_clean(eng)


def test_prefix_cache_evicts_under_pressure(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir, block_size=8, num_kv_blocks=24)
    prompts = [[(i * 131 + j) % 3000 + 50 for j in range(60)] for i in range(6)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    assert eng.pool.evictions > 0
    ref = tiny_engine(tiny_model_dir, num_kv_blocks=512).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert_pool_clean(eng)


def test_request_joins_running_batch_next_step(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir)
    eng.trace = []
    eng.add_request("long", list(range(100, 120)),
                    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    eng.add_request("short", list(range(200, 210)),
                    SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    for _ in range(5):
        eng.step()
    late_step = len(eng.trace) + 1
    eng.add_request("late", list(range(300, 312)),
                    SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    by_step = {t.step: dict(t.scheduled) for t in eng.trace}
    # the late request's prefill runs in the very next step, beside the long decode
    assert by_step[late_step] == {"long": 1, "late": 12}
    # the short request finished and left while the long one kept going
    short_done = next(t.step for t in eng.trace if "short" in t.finished)
    long_done = next(t.step for t in eng.trace if "long" in t.finished)
    assert short_done < late_step < long_done
    assert all("short" not in dict(t.scheduled) for t in eng.trace if t.step > short_done)
    assert_pool_clean(eng)


def _prefill_steps(eng) -> list[dict[str, int]]:
    """Each step's prompt chunks (more than one token), in step order."""
    steps = [{rid: n for rid, n in t.scheduled if n > 1} for t in eng.trace]
    return [s for s in steps if s]


def test_prompts_waiting_together_are_prefilled_one_at_a_time(tiny_model_dir):
    prompts = {f"p{i}": [(i * 53 + j) % 3000 + 70 for j in range(20)] for i in range(3)}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outputs = []
    for serial_queue, expected in ((8, [{"p0": 20}, {"p1": 20}, {"p2": 20}]),
                                   (2, [{"p0": 20, "p1": 20, "p2": 20}])):
        eng = tiny_engine(tiny_model_dir)
        eng.scheduler.serial_queue = serial_queue  # 3 waiting: one at a time, or a backlog
        eng.trace = []
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        first_step = {}
        while eng.has_unfinished():
            for delta in eng.step():
                tokens[delta.request_id] += delta.new_token_ids
                if delta.new_token_ids:
                    first_step.setdefault(delta.request_id, len(eng.trace))
        assert _prefill_steps(eng) == expected
        if serial_queue == 8:  # each prompt's first token a step before the next one's
            assert first_step["p0"] < first_step["p1"] < first_step["p2"]
            # p0 decodes beside p1's prefill: nobody waits for a prompt but the ones ahead
            assert dict(eng.trace[1].scheduled) == {"p0": 1, "p1": 20}
        outputs.append(tokens)
        assert_pool_clean(eng)
    assert outputs[0] == outputs[1]


def test_prompts_arriving_together_share_their_common_prefix(tiny_model_dir):
    # one prompt a step: the second is admitted after the first's blocks are in the prefix
    # cache, so it computes only its own tail (packed into one step, both computed all)
    eng = tiny_engine(tiny_model_dir, block_size=16)
    shared = [(7 * j) % 3000 + 100 for j in range(48)]  # 3 full blocks
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.trace = []
    eng.add_request("first", shared + [11, 12, 13], params)
    eng.add_request("second", shared + [21, 22], params)
    hits_before = eng.pool.prefix_hits
    while eng.has_unfinished():
        eng.step()
    assert _prefill_steps(eng) == [{"first": 51}, {"second": 2}]
    assert eng.pool.prefix_hits - hits_before == 48
    assert_pool_clean(eng)


def test_long_prompt_is_chunked(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir, max_num_batched_tokens=32)
    eng.trace = []
    eng.add_request("a", list(range(100, 110)),
                    SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eng.step()
    eng.add_request("big", list(range(500, 600)),
                    SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    chunks = [dict(t.scheduled).get("big") for t in eng.trace]
    big_prefill = [c for c in chunks if c and c > 1]
    assert sum(big_prefill) == 100 and max(big_prefill) <= 31
    # the running decode kept a token in every step the big prompt was prefilling
    assert all(dict(t.scheduled).get("a") == 1 for t in eng.trace
               if (dict(t.scheduled).get("big") or 0) > 1)
    assert_pool_clean(eng)


def test_preemption_completes_with_parity(tiny_model_dir):
    prompts = [[(i * 97 + j) % 3000 + 50 for j in range(20 + 7 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eng = tiny_engine(tiny_model_dir, block_size=8, num_kv_blocks=24)  # far too small for all
    eng.trace = []
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert any(t.preempted for t in eng.trace)
    refs = hf_greedy(tiny_model_dir, prompts, 40)
    assert [o.token_ids for o in outs] == refs
    assert_pool_clean(eng)


def test_seed_reproducible_alone_and_in_batch(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    alone = eng.generate([list(range(100, 130))], p)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batch = eng.generate([list(range(300, 320)), list(range(100, 130)), list(range(50, 90))],
                         [others, p, others])
    assert batch[1].token_ids == alone
    assert_pool_clean(eng)


def test_top_k_1_equals_greedy_and_penalties_run(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir)
    prompt = [list(range(100, 140))]
    greedy = eng.generate(prompt, GREEDY)[0].token_ids
    k1 = eng.generate(prompt, SamplingParams(max_tokens=16, temperature=1.3, top_k=1,
                                             ignore_eos=True))[0].token_ids
    assert k1 == greedy
    # a repetition penalty this strong leaves every seen token's logit near 0 or far below,
    # so greedy picks a fresh token each step: none from the prompt, none twice
    pen = eng.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                              repetition_penalty=1e4))[0].token_ids
    assert len(set(pen)) == 16 and not set(pen) & set(prompt[0])
    # a frequency penalty of 2 per occurrence against logits of this model's spread: the
    # numbers themselves are checked in test_device_sampler.test_penalty_formulas
    freq = eng.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                               frequency_penalty=2.0))[0].token_ids
    assert max(freq.count(t) for t in freq) <= max(greedy.count(t) for t in greedy)
    assert_pool_clean(eng)


def test_stop_tokens_min_tokens_and_logprobs(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir)
    prompt = [list(range(100, 140))]
    greedy = eng.generate(prompt, GREEDY)[0].token_ids
    stop_at = greedy[5]
    out = eng.generate(prompt, SamplingParams(max_tokens=16, temperature=0,
                                              stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy[:greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    out = eng.generate(prompt, SamplingParams(max_tokens=16, temperature=0, min_tokens=16,
                                              stop_token_ids=[stop_at]))[0]
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    assert stop_at not in out.token_ids  # banned until min_tokens
    out = eng.generate(prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                              ignore_eos=True))[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(lp.top[0][0] == t and len(lp.top) == 3 for lp, t in zip(out.logprobs,
                                                                         out.token_ids))
    assert_pool_clean(eng)


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", {"temperature": -0.5}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_p", {"min_p": 2.0}),
    ("min_tokens", {"max_tokens": 2, "min_tokens": 3}),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_too_long_and_max_tokens_too_big(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("x", list(range(1, 1100)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("y", list(range(1, 100)), SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("z", [], SamplingParams(max_tokens=1))
    assert_pool_clean(eng)


def test_kv_cache_dtype_halves_kv_memory(tiny_model_dir):
    """kv_cache_dtype bfloat16 under a float32 model: twice the blocks for the same budget,
    the cache tensors in bf16, the model still float32."""
    fp32 = tiny_engine(tiny_model_dir, num_kv_blocks=None, kv_cache_memory="4MiB")
    bf16 = tiny_engine(tiny_model_dir, num_kv_blocks=None, kv_cache_memory="4MiB",
                       kv_cache_dtype="bfloat16")
    assert bf16.kv_spec.num_blocks == 2 * fp32.kv_spec.num_blocks
    assert bf16.kv_spec.dtype == "bfloat16" and bf16.kv_cache.value(1).dtype == torch.bfloat16
    assert bf16.model.dtype == torch.float32
    out = bf16.generate([[11, 12, 13, 14, 15]], SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].token_ids) == 8
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(kv_cache_dtype="int8")
