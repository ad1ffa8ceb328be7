"""The gateway end to end with real prefill and decode workers on 127.0.0.1: the OpenAI
API (through the `openai` package), the gRPC API and reflection, /metrics, bad input, stop
strings, deadlines and client disconnects — and no leaked KV blocks after any of it."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest
from conftest import tiny_engine
from test_gateway_support import Cluster

from pdserve.client import PdserveClient
from pdserve.protocol import SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog because",
           "Hello",
           ("In a distant galaxy, far beyond the reach of any telescope, there lived a "
           "small robot who dreamed of")]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    # prompts under 8 tokens run colocated, longer ones disaggregated: both paths are used
    c = Cluster(tiny_model_dir, disagg_threshold=8)
    c.add_worker("prefill")
    c.add_worker("decode")
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir, num_threads=1)
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    outs = eng.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return {p: (o.token_ids, eng.tokenizer.decode(o.token_ids, skip_special_tokens=True))
            for p, o in zip(PROMPTS, outs)}


@pytest.fixture
def oai(cluster):
    import openai

    return openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)


def _post(cluster, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(cluster.gateway.http_url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_openai_completions_equal_the_engine(cluster, oai, reference, tiny_model_dir):
    model = tiny_model_dir.rstrip("/").rsplit("/", 1)[-1]  # the basename is accepted too
    for p in PROMPTS:
        r = oai.completions.create(model=model, prompt=p, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert r.choices[0].text == reference[p][1]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
        stream = oai.completions.create(model=tiny_model_dir, prompt=p, max_tokens=12,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[p][1]
        assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    cluster.assert_no_leaks()


def test_openai_chat_streaming_and_not(cluster, oai):
    msgs = [{"role": "user", "content": "Say something about 猫 and 🐱"}]
    r = oai.chat.completions.create(model=tiny_model_dir_name(cluster), messages=msgs,
                                    max_tokens=10, temperature=0, logprobs=True,
                                    top_logprobs=2, extra_body={"ignore_eos": True})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    assert len(r.choices[0].logprobs.content) == 10
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    s = oai.chat.completions.create(model=tiny_model_dir_name(cluster), messages=msgs,
                                    max_tokens=10, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = list(s)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    cluster.assert_no_leaks()


def tiny_model_dir_name(cluster) -> str:
    return cluster.gateway.config.model


def test_grpc_client_streams_tokens_and_reflection_lists_services(cluster, reference):
    async def main():
        async with PdserveClient(cluster.gateway.grpc_address) as c:
            [info] = await c.list_models()
            assert info.num_decode_workers == 1 and info.num_prefill_workers == 1
            for p in PROMPTS:
                chunks = [x async for x in c.generate(p, max_tokens=12, temperature=0,
                                                       ignore_eos=True)]
                ids = [t for x in chunks for t in x.token_ids]
                assert ids == reference[p][0]
                assert "".join(x.text for x in chunks) == reference[p][1]
                assert chunks[-1].finish_reason == "length"
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        async with grpc.aio.insecure_channel(cluster.gateway.grpc_address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            async for resp in stub.ServerReflectionInfo(iter([req])):
                names = {s.name for s in resp.list_services_response.service}
            assert {"pdserve.v1.Gateway", "grpc.health.v1.Health"} <= names
    asyncio.run(main())
    cluster.assert_no_leaks()


def test_metrics_add_up(cluster, oai):
    from prometheus_client.parser import text_string_to_metric_families

    def parse(pages: list[str]) -> dict:
        out: dict = {}
        for fam in (f for text in pages for f in text_string_to_metric_families(text)):
            for s in fam.samples:
                key = (s.name, s.labels.get("finished_reason") or s.labels.get("code"))
                out[key] = out.get(key, 0) + s.value
        return out

    def scrape() -> dict:
        """The gateway's /metrics, and under ("workers", name) the workers' expositions
        summed (the workers here serve no /metrics port: their own registry's text)."""
        with urllib.request.urlopen(cluster.gateway.http_url + "/metrics") as r:
            out = parse([r.read().decode()])
        for w in cluster.workers:
            w.refresh_metrics()
        workers = parse([w.metrics.exposition().decode() for w in cluster.workers])
        out.update({("workers", name): v for (name, _), v in workers.items()})
        return out

    before = scrape()
    n, sent_out, sent_prompt = 5, 0, 0
    for i in range(n):
        r = oai.completions.create(model=cluster.gateway.config.model, prompt=PROMPTS[i % 3],
                                   max_tokens=3 + i, temperature=0,
                                   extra_body={"ignore_eos": True})
        sent_out += r.usage.completion_tokens
        sent_prompt += r.usage.prompt_tokens
    after = scrape()

    def delta(name: str, label: str | None = None) -> float:
        """(name, label) on the gateway; ("workers", name) summed over the workers."""
        return after.get((name, label), 0) - before.get((name, label), 0)

    assert delta("pdserve:request_success_total", "length") == n
    assert delta("pdserve:e2e_request_latency_seconds_count") == n
    assert delta("pdserve:time_to_first_token_seconds_count") == n
    assert delta("pdserve:generation_tokens_total") == sent_out
    assert delta("pdserve:prompt_tokens_total") == sent_prompt
    assert delta("pdserve:inter_token_latency_seconds_count") == sent_out - n
    # every token after a request's first is its own decode step (these ran one at a time)
    assert delta("workers", "pdserve:engine_steps_total") >= sent_out - n
    assert 0 < delta("workers", "pdserve:engine_forward_seconds_total") \
        <= delta("workers", "pdserve:engine_step_seconds_total")
    # prompts 0, 2, 0 are long enough to be disaggregated; "Hello" runs colocated
    assert delta("pdserve:kv_transfer_seconds_count") == 3


@pytest.mark.parametrize("body,status,param", [
    (b'{"prompt": "", "max_tokens": 4}', 400, "prompt"),
    (json.dumps({"prompt": "hi " * 1100, "max_tokens": 4}).encode(), 400, "prompt"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 100000000}', 400, "max_tokens"),
    (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "hi", "top_p": 2}', 400, "top_p"),
    (b'{"prompt": "hi", "n": 3}', 400, "n"),
    (b'{"prompt": "hi", "model": "no-such-model"}', 404, "model"),
    (b'{"prompt": "hi", ', 400, "body"),
    (b'{"prompt": "\xff\xfe"}', 400, "body"),
])
def test_bad_input(cluster, body, status, param):
    code, err = _post(cluster, "/v1/completions", body)
    assert code == status, err
    assert err["error"]["param"] == param and param in err["error"]["message"]
    assert set(err["error"]) == {"message", "type", "param", "code"}
    cluster.assert_no_leaks()


def test_grpc_bad_input(cluster):
    async def main():
        async with PdserveClient(cluster.gateway.grpc_address) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [x async for x in c.generate("hi", top_p=2.0)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "top_p" in e.value.details()
    asyncio.run(main())


def test_stop_string_cancels_at_the_worker(cluster, oai, reference):
    p = PROMPTS[0]
    text = reference[p][1]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    r = oai.completions.create(model=cluster.gateway.config.model, prompt=p, max_tokens=200,
                               temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.usage.completion_tokens < 200
    cluster.assert_no_leaks()


def test_deadline_and_disconnect_free_blocks(cluster, oai):
    code, err = _post(cluster, "/v1/completions",
                      json.dumps({"prompt": PROMPTS[2], "max_tokens": 900,
                                  "ignore_eos": True}).encode(),
                      headers={"X-Request-Timeout": "0.3"})
    assert code == 504 and err["error"]["param"] == "timeout"
    cluster.assert_no_leaks()

    async def leave_early():
        async with PdserveClient(cluster.gateway.grpc_address) as c:
            async for _ in c.generate(PROMPTS[2], max_tokens=900, ignore_eos=True):
                break  # the client goes away mid-stream
    asyncio.run(leave_early())
    cluster.assert_no_leaks()

    async def http_disconnect():
        import aiohttp

        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
                "ignore_eos": True, "stream": True}
        url = cluster.gateway.http_url + "/v1/chat/completions"
        async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the first event, then hang up
    asyncio.run(http_disconnect())
    cluster.assert_no_leaks()
    cluster.wait_for(lambda: cluster.gateway.admission.stats().inflight == 0)


def test_cli_serves_health_and_stops_on_sigterm(tiny_model_dir):
    import re
    import signal
    import subprocess
    import sys

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    help_text = subprocess.run([sys.executable, "-m", "pdserve.gateway", "--help"], check=True,
                               capture_output=True, text=True).stdout
    for flag in ("--model", "--prefill", "--decode", "--disagg-threshold", "--max-queue",
                 "--max-inflight", "--heartbeat-timeout", "--default-max-tokens"):
        assert flag in help_text
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.gateway", "--model", tiny_model_dir,
                             "--http-port", "0", "--grpc-port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            m = re.search(r"gateway ready: grpc=(\S+) http=(\S+)", line)
            if m:
                break
        assert m, "the gateway never became ready"
        grpc_addr, http_url = m.groups()
        assert grpc_addr.startswith("127.0.0.1:")  # loopback by default
        # up, but with no decode worker nothing can be routed: health says so
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(http_url + "/health")
        assert e.value.code == 503
        with grpc.insecure_channel(grpc_addr) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        code, err = _post_url(http_url, b'{"prompt": "hi"}')
        assert code == 503 and "decode worker" in err["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def _post_url(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
