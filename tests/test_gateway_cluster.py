"""The gateway with workers coming and going: overload (429 / RESOURCE_EXHAUSTED while every
accepted request completes), a decode worker registered at runtime, a crashed one dropped
within the heartbeat timeout, static worker addresses, prefill paired only with decode
workers of its KV layout, and the real SmolLM2 once."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_support import Cluster

from pdserve.client import PdserveClient
from pdserve.gateway.registry import Role
from pdserve.gateway.server import Gateway, GatewayConfig


async def _all(*coros):
    return await asyncio.gather(*coros)


PROMPT = "Once upon a time, in a land of rivers and hills, a curious child asked"


async def _grpc_one(address: str, max_tokens: int = 24) -> str:
    async with PdserveClient(address) as c:
        try:
            chunks = [x async for x in c.generate(PROMPT, max_tokens=max_tokens,
                                                   temperature=0, ignore_eos=True)]
            assert chunks[-1].completion_tokens == max_tokens
            return "ok"
        except grpc.aio.AioRpcError as e:
            return e.code().name


async def _http_one(url: str) -> tuple[int, str | None]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}) as r:
        body = await r.json()
        if r.status == 200:
            assert body["usage"]["completion_tokens"] == 24
        return r.status, r.headers.get("Retry-After")


def test_overload_refuses_the_excess_and_completes_the_rest(tiny_model_dir):
    c = Cluster(tiny_model_dir, max_inflight=1, max_queue=2)
    try:
        c.add_worker("prefill")
        c.add_worker("decode")
        results = c.lt.run(_all(*[_grpc_one(c.gateway.grpc_address)
                                            for _ in range(7)]))
        assert results.count("ok") == 3, results
        assert results.count("RESOURCE_EXHAUSTED") == 4, results
        http = c.lt.run(_all(*[_http_one(c.gateway.http_url) for _ in range(6)]))
        assert sorted(s for s, _ in http) == [200] * 3 + [429] * 3, http
        assert all(int(ra) >= 1 for s, ra in http if s == 429)
        c.assert_no_leaks()
    finally:
        c.close()


def test_workers_join_and_crash_at_runtime(tiny_model_dir):
    c = Cluster(tiny_model_dir, heartbeat_timeout_s=1.5)
    try:
        c.add_worker("prefill")
        a = c.add_worker("decode")
        b = c.add_worker("decode")  # registered while the gateway runs
        assert len(c.gateway.registry.alive(Role.DECODE)) == 2
        gen_b = b.engine.counters.generation_tokens
        results = c.lt.run(_all(*[_grpc_one(c.gateway.grpc_address, 8)
                                            for _ in range(6)]))
        assert results == ["ok"] * 6
        assert b.engine.counters.generation_tokens > gen_b  # the newcomer got traffic
        c.assert_no_leaks()

        c.crash(a)
        t0 = time.monotonic()
        # requests in the window before expiry fail over to b
        assert c.lt.run(_grpc_one(c.gateway.grpc_address, 4)) == "ok"
        c.wait_for(lambda: [w.address for w in c.gateway.registry.alive(Role.DECODE)]
                   == [b.address], timeout=3.0)
        assert time.monotonic() - t0 <= 1.5 + 0.5
        gen_b = b.engine.counters.generation_tokens
        results = c.lt.run(_all(*[_grpc_one(c.gateway.grpc_address, 4)
                                            for _ in range(4)]))
        assert results == ["ok"] * 4
        assert b.engine.counters.generation_tokens - gen_b == 16
        c.assert_no_leaks()

        # a second gateway that knows the same workers only from its command line
        g2 = Gateway(GatewayConfig(model=tiny_model_dir, http_port=0, grpc_port=0,
                                   decode=(b.address,), prefill=(c.workers[0].address,)))
        c.lt.run(g2.start())
        try:
            assert c.lt.run(_grpc_one(g2.grpc_address, 4)) == "ok"
            assert len(g2.registry.alive(Role.PREFILL)) == 1
        finally:
            c.lt.run(g2.stop(1.0))
        c.assert_no_leaks()
    finally:
        c.close()


@pytest.mark.slow
def test_real_smollm2_chat_matches_the_engine(tmp_path):
    import openai

    from pdserve.decode_worker.server import DecodeWorker
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.protocol import SamplingParams
    from pdserve.worker_runtime import WorkerConfig

    eng = LLMEngine(EngineConfig(model="smollm2-135m", kv_cache_memory="64MiB",
                                 max_num_batched_tokens=256, show_progress=False,
                                 num_threads=1))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True))
    [ref] = eng.generate([ids], SamplingParams(max_tokens=16, temperature=0))
    c = Cluster("smollm2-135m")
    try:
        w = DecodeWorker(WorkerConfig(engine=eng.config, gateways=(c.gateway.registry_address,)),
                         engine=eng)
        c.lt.run(w.start())
        c.workers.append(w)
        c.wait_for(lambda: c.gateway.registry.alive(Role.DECODE))
        client = openai.OpenAI(base_url=c.base_url, api_key="none", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m", messages=msgs,
                                           max_tokens=16, temperature=0)
        assert r.choices[0].message.content == eng.tokenizer.decode(
            ref.token_ids, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(ids)
        c.assert_no_leaks()
    finally:
        c.close()


def test_prefill_pairs_only_with_decode_workers_of_its_kv_layout(tiny_model_dir):
    """A prefill worker whose KV dtype no decode worker shares gets no prompts: long prompts
    run colocated (not FAILED_PRECONDITION at Prefill); a compatible prefill worker added
    later gets them, the incompatible one still none."""
    c = Cluster(tiny_model_dir, disagg_threshold=8)
    try:
        c.add_worker("decode", kv_cache_dtype="float32")
        bf16 = c.add_worker("prefill", kv_cache_dtype="bfloat16")
        prompt = list(range(100, 140))  # 40 tokens: disaggregated when a pair exists

        async def one() -> tuple[int, ...]:
            async with PdserveClient(c.gateway.grpc_address) as cl:
                return tuple([t async for ch in cl.generate(token_ids=prompt, max_tokens=4,
                                                            temperature=0, ignore_eos=True)
                              for t in ch.token_ids])

        def failovers() -> float:
            text = c.gateway.orchestrator.metrics.exposition().decode()
            return sum(x.value for f in text_string_to_metric_families(text) for x in f.samples
                       if x.name == "pdserve:request_migrations_total"
                       and x.labels["reason"] == "prefill_failover")

        colocated = c.lt.run(one())
        assert len(colocated) == 4
        # never sent there: no Prefill refused with FAILED_PRECONDITION and failed over
        assert failovers() == 0
        assert bf16.engine.counters.prompt_tokens == 0
        f32 = c.add_worker("prefill", kv_cache_dtype="float32")
        assert c.lt.run(one()) == colocated  # same output, now disaggregated
        assert f32.engine.counters.prompt_tokens == len(prompt)
        assert bf16.engine.counters.prompt_tokens == 0
        assert failovers() == 0
        c.assert_no_leaks()
    finally:
        c.close()
