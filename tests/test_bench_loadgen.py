"""Tests for bench/: workloads (determinism, exact token counts), metrics math, and the HTTP
client, runner and `pdserve bench` command line against a real local SSE server."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from pdserve.bench import loadgen
from pdserve.bench.clients import GatewayGRPCClient, OpenAIHTTPClient, RequestRecord
from pdserve.bench.metrics import compute_report, itl_s, percentile, tpot_s
from pdserve.bench.runner import run_benchmark
from pdserve.bench.workloads import (
    BenchRequest,
    ChatMessage,
    count_tokens,
    fit_text,
    make_workload,
    rate_sweep,
    with_arrivals,
)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


# --- workloads ---------------------------------------------------------------------------


def test_fit_text_is_exact_for_every_length(tok) -> None:
    import random

    rng = random.Random(7)
    for n in list(range(1, 200)) + [511, 1024, 2048]:
        assert len(tok.encode(fit_text(tok, rng, n))) == n


@pytest.mark.parametrize("name", ["fixed", "mixed", "long-prompt", "shared-prefix"])
def test_workloads_are_deterministic_per_seed(tok, name: str) -> None:
    a = make_workload(name, tok, 24, seed=3)
    assert a == make_workload(name, tok, 24, seed=3)
    assert a != make_workload(name, tok, 24, seed=4)
    assert [r.request_id for r in a] == list(range(24))


def test_prompt_workloads_hit_token_counts_exactly(tok) -> None:
    fixed = make_workload("fixed", tok, 10, seed=0, input_len=100, output_len=7)
    assert all(len(tok.encode(r.prompt)) == 100 and r.output_tokens == 7 for r in fixed)
    assert len({r.prompt for r in fixed}) == 10  # no accidental shared prompts

    mixed = make_workload("mixed", tok, 200, seed=1)
    for r in mixed:
        assert len(tok.encode(r.prompt)) == r.prompt_tokens
        assert 32 <= r.prompt_tokens <= 512 and 16 <= r.output_tokens <= 256
    # log-uniform skews short: the median sits below the midpoint of the range
    assert sorted(r.prompt_tokens for r in mixed)[100] < (32 + 512) / 2

    long = make_workload("long-prompt", tok, 100, seed=2)
    assert all(len(tok.encode(r.prompt)) == r.prompt_tokens for r in long)
    n_long = sum(r.prompt_tokens >= 1024 for r in long)
    assert 10 <= n_long <= 35  # 20% expected; seeded, so this is a fixed number
    assert all(r.prompt_tokens <= 256 for r in long if r.prompt_tokens < 1024)


def test_shared_prefix_chats(tok) -> None:
    reqs = make_workload("shared-prefix", tok, 40, seed=5, system_len=300)
    system = reqs[0].messages[0]
    assert system.role == "system" and len(tok.encode(system.content)) == 300
    for r in reqs:
        assert r.messages[0] == system
        assert [m.role for m in r.messages][1:] == ["user", "assistant"] * r.turn + ["user"]
        rendered = tok.apply_chat_template(
            [m.to_json() for m in r.messages], tokenize=False, add_generation_prompt=True
        )
        assert len(tok.encode(rendered)) == r.prompt_tokens  # exactly what gets prefilled
        assert 32 <= len(tok.encode(r.messages[-1].content)) <= 128
    sessions = {r.session_id for r in reqs if r.session_id is not None}
    assert sessions, "some conversations are multi-turn"
    for sid in sessions:
        turns = [r for r in reqs if r.session_id == sid]
        assert [r.turn for r in turns] == list(range(len(turns)))  # in order in the list
        for prev, cur in itertools.pairwise(turns):  # each turn resends the previous history
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert len(tok.encode(cur.messages[len(prev.messages)].content)) == prev.output_tokens


def test_arrivals() -> None:
    reqs = [
        BenchRequest(request_id=i, prompt="x", prompt_tokens=1, output_tokens=1)
        for i in range(2000)
    ]
    assert all(r.arrival_s == 0.0 for r in with_arrivals(reqs, math.inf, seed=0))
    poisson = with_arrivals(reqs, 10.0, seed=0)
    times = [r.arrival_s for r in poisson]
    assert times[0] == 0.0 and times == sorted(times)
    assert times == [r.arrival_s for r in with_arrivals(reqs, 10.0, seed=0)]
    assert times != [r.arrival_s for r in with_arrivals(reqs, 10.0, seed=1)]
    assert 0.09 < times[-1] / 1999 < 0.11  # mean gap 1/rate (2000 draws)
    runs = rate_sweep(reqs[:50], [1.0, 4.0, math.inf], seed=0)
    assert [run.rate for run in runs] == [1.0, 4.0, math.inf]
    for slow, fast in zip(runs[0].requests, runs[1].requests):
        assert fast.arrival_s == pytest.approx(slow.arrival_s / 4)
    assert all(r.arrival_s == 0.0 for r in runs[2].requests)


# --- metrics -----------------------------------------------------------------------------


def _record(
    rid: int,
    send: float,
    tokens: list[float],
    usage: int | None,
    expected: int,
    error: str | None = None,
    status: int = 200,
) -> RequestRecord:
    rec = RequestRecord(
        request_id=rid,
        prompt_tokens=10,
        expected_output_tokens=expected,
        send_time=send,
        error=error,
        status=status,
    )
    for t in tokens:
        rec.add_token_event(t)
    rec.end_time = tokens[-1] if tokens else send + 0.05
    rec.usage_output_tokens = usage
    return rec


def test_percentile_linear_interpolation() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)  # rank 2.85
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0], 100) == 3.0


def test_report_on_hand_built_records() -> None:
    records = [
        # ttft 0.1, e2e 0.5, 5 tokens: tpot 0.4/4 = 0.1, itl 4 x 0.1
        _record(0, 0.0, [0.1, 0.2, 0.3, 0.4, 0.5], usage=5, expected=5),
        # ttft 0.2, e2e 0.8, 3 tokens: tpot 0.6/2 = 0.3, itl 2 x 0.3; asked for 4 (short)
        _record(1, 1.0, [1.2, 1.5, 1.8], usage=3, expected=4),
        # ttft 0.3, e2e 0.3, 1 token: no tpot, no itl
        _record(2, 2.0, [2.3], usage=1, expected=1),
        # ttft 0.4, e2e 0.6, 3 chunks but the server's usage says 5: tpot 0.2/4 = 0.05
        _record(3, 0.5, [0.9, 1.0, 1.1], usage=5, expected=5),
        _record(4, 0.2, [], usage=None, expected=5, error="HTTP 503: busy", status=503),
    ]
    assert tpot_s(records[3]) == pytest.approx(0.05)
    assert itl_s(records[1]) == pytest.approx([0.3, 0.3])

    rep = compute_report(
        records, label="x", rate=2.0, duration_s=2.5, ttft_slo_s=0.35, tpot_slo_s=0.2
    )
    assert (rep.num_requests, rep.completed, rep.failed, rep.short_outputs) == (5, 4, 1, 1)
    assert rep.errors == {"503": 1}
    assert rep.request_throughput == pytest.approx(4 / 2.5)
    assert rep.output_throughput == pytest.approx((5 + 3 + 1 + 5) / 2.5)
    assert rep.total_token_throughput == pytest.approx((5 + 3 + 1 + 5 + 4 * 10) / 2.5)
    # TTFT ms sorted [100, 200, 300, 400]: P95 at rank 2.85 -> 300 + 0.85*100
    assert rep.ttft_ms.count == 4
    assert rep.ttft_ms.mean == pytest.approx(250)
    assert rep.ttft_ms.p50 == pytest.approx(250)
    assert rep.ttft_ms.p95 == pytest.approx(385)
    assert rep.ttft_ms.p99 == pytest.approx(397)
    # TPOT ms sorted [50, 100, 300]: P95 at rank 1.9 -> 100 + 0.9*200
    assert rep.tpot_ms.count == 3
    assert rep.tpot_ms.mean == pytest.approx(150)
    assert rep.tpot_ms.p50 == pytest.approx(100)
    assert rep.tpot_ms.p95 == pytest.approx(280)
    assert rep.tpot_ms.p99 == pytest.approx(296)
    # ITL ms: 4 x 100, 2 x 300, 2 x 100 -> six 100s then two 300s; P50 at rank 3.5
    assert rep.itl_ms.count == 8
    assert rep.itl_ms.mean == pytest.approx(150)
    assert rep.itl_ms.p50 == pytest.approx(100)
    assert rep.itl_ms.p99 == pytest.approx(300)
    # E2E ms sorted [300, 500, 600, 800]: P99 at rank 2.97 -> 600 + 0.97*200
    assert rep.e2e_ms.p50 == pytest.approx(550)
    assert rep.e2e_ms.p99 == pytest.approx(794)
    # Goodput: r0 meets both; r1 misses TPOT (300 > 200); r2 has TTFT 300 <= 350 and no
    # TPOT; r3 misses TTFT (400); r4 failed -> 2 good requests over 2.5 s.
    assert rep.goodput == pytest.approx(2 / 2.5)
    assert rep.slo_attainment == pytest.approx(2 / 5)
    tight = compute_report(records, duration_s=2.5, ttft_slo_s=0.25, tpot_slo_s=0.2)
    assert tight.goodput == pytest.approx(1 / 2.5)  # only r0
    loose = compute_report(records, duration_s=2.5)
    assert loose.goodput == pytest.approx(4 / 2.5)  # no SLO: every success counts
    json.dumps(rep.to_dict(), allow_nan=False)
    empty = compute_report([records[4]])
    assert empty.ttft_ms.p99 is None and empty.duration_s == pytest.approx(0.05)
    json.dumps(empty.to_dict(), allow_nan=False)


# --- HTTP client against a real local server ---------------------------------------------

TTFT_DELAY = 0.2
ITL_DELAY = 0.04


class FakeOpenAIServer:
    """A real aiohttp OpenAI-style streaming server on 127.0.0.1, in its own thread.

    It waits TTFT_DELAY, then streams `max_tokens` chunks ITL_DELAY apart (each written in
    two pieces, to exercise line reassembly), a usage chunk and `[DONE]`. Model "broken"
    gets HTTP 503.
    """

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.started.set()
        self.loop.run_forever()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["model"] == "broken":
            return web.json_response({"error": {"message": "busy"}}, status=503)
        chat = request.path.endswith("/chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(obj: dict) -> None:
            data = f"data: {json.dumps(obj)}\n\n".encode()
            await resp.write(data[:9])
            await resp.write(data[9:])

        await resp.write(b": keep-alive\n\n")
        if chat:  # OpenAI sends the role first, with empty content: not a token
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(TTFT_DELAY)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(ITL_DELAY)
            piece = f" w{i}"
            choice = {"index": 0, "finish_reason": None}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            await event({"choices": [choice]})
        n = body["max_tokens"]
        await event(
            {
                "choices": [],
                "usage": {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n},
            }
        )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def __enter__(self):  # -> FakeOpenAIServer
        self.thread.start()
        self.started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as srv:
        yield srv


def _req(rid: int, out: int, chat: bool = False) -> BenchRequest:
    if chat:
        msgs = (ChatMessage("system", "be brief"), ChatMessage("user", "hello there"))
        return BenchRequest(request_id=rid, messages=msgs, prompt_tokens=20, output_tokens=out)
    return BenchRequest(request_id=rid, prompt="hello there", prompt_tokens=2, output_tokens=out)


def test_http_client_measures_streamed_tokens(server: FakeOpenAIServer) -> None:
    reqs = [_req(0, 6), _req(1, 6, chat=True), _req(2, 1), _req(3, 6, chat=True)]

    async def go():
        async with OpenAIHTTPClient(server.url + "/v1", "m") as client:
            return await run_benchmark(
                client, reqs, max_concurrency=2, progress=False, ttft_slo_s=10.0, tpot_slo_s=10.0
            )

    result = asyncio.run(go())
    body = server.bodies[-1]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert any("messages" in b and b["messages"][0]["role"] == "system" for b in server.bodies)
    assert any(b.get("prompt") == "hello there" for b in server.bodies)
    eps = 0.01  # event-loop wake-up slack; only lower bounds on timing are asserted
    for rec, req in zip(result.records, reqs):
        assert rec.ok, rec.error
        assert rec.status == 200
        assert rec.chunk_count == req.output_tokens  # the chat role chunk is not a token
        assert rec.output_tokens == rec.usage_output_tokens == req.output_tokens
        assert rec.usage_prompt_tokens == 11
        ttft = rec.first_token_time - rec.send_time
        e2e = rec.end_time - rec.send_time
        assert TTFT_DELAY - eps <= ttft < 10
        assert e2e >= TTFT_DELAY + (req.output_tokens - 1) * ITL_DELAY - eps
    rep = result.report
    assert rep.completed == 4 and rep.failed == 0 and rep.short_outputs == 0
    assert rep.output_throughput > 0 and rep.goodput == rep.request_throughput
    assert rep.ttft_ms.p50 >= (TTFT_DELAY - eps) * 1000
    assert rep.itl_ms.count == 3 * 5
    assert rep.itl_ms.p50 >= (ITL_DELAY - eps) * 1000
    assert rep.tpot_ms.p50 >= (ITL_DELAY - eps) * 1000


def test_http_errors_and_time_limit(server: FakeOpenAIServer) -> None:
    async def go():
        async with OpenAIHTTPClient(server.url, "broken") as client:
            failed = await client.run(_req(0, 4))
        async with OpenAIHTTPClient(server.url, "m") as client:
            reqs = [_req(0, 50), dataclasses.replace(_req(1, 2), arrival_s=5.0)]
            limited = await run_benchmark(client, reqs, time_limit_s=0.5, progress=False)
        return failed, limited

    failed, limited = asyncio.run(go())
    assert failed.status == 503 and failed.error.startswith("HTTP 503") and not failed.ok
    timed_out, not_sent = limited.records
    assert timed_out.error.startswith("timeout") and 0 < timed_out.chunk_count < 50
    assert not_sent.error.startswith("not sent") and not_sent.send_time is None
    assert limited.report.failed == 2 and limited.report.completed == 0
    assert limited.report.duration_s < 3


def test_loadgen_main_sweep_json_and_plots(server, tok, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loadgen, "load_tokenizer", lambda path=None: tok)
    out = tmp_path / "results.json"
    common = [
        "--url",
        server.url,
        "--workload",
        "fixed",
        "--input-len",
        "16",
        "--output-len",
        "3",
        "--num-requests",
        "4",
        "--out",
        str(out),
        "--plot-dir",
        str(tmp_path / "plots"),
        "--no-progress",
        "--ttft-slo",
        "5000",
        "--tpot-slo",
        "1000",
    ]
    assert loadgen.main(common + ["--rates", "40", "inf", "--label", "a"]) == 0
    assert loadgen.main(common + ["--rate", "40", "--label", "b", "--append"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["label"], r["rate"]) for r in runs] == [("a", 40.0), ("a", None), ("b", 40.0)]
    for run in runs:
        assert run["report"]["completed"] == 4 and len(run["requests"]) == 4
        assert run["report"]["goodput"] > 0 and run["requests"][0]["output_tokens"] == 3
    prompts = [b["prompt"] for b in server.bodies[-4:]]
    assert all(count_tokens(tok, p) == 16 for p in prompts)
    for name in ("latency_cdf.png", "rate_sweep.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_loadgen_help_is_truthful(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        loadgen.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--url",
        "--grpc",
        "--workload",
        "--num-requests",
        "--rate",
        "--rates",
        "--seed",
        "--input-len",
        "--output-len",
        "--ttft-slo",
        "--tpot-slo",
        "--out",
        "--plot-dir",
        "--model",
        "--label",
    ):
        assert flag in text
    with pytest.raises(SystemExit):
        loadgen.main(["--url", "http://x", "--grpc", "y:1"])  # one target only


# --- gRPC client against a real local gateway stub ---------------------------------------


def test_grpc_client_against_a_fake_gateway() -> None:
    import grpc

    from pdserve.protos.pdserve.v1 import gateway_pb2, gateway_pb2_grpc

    seen: list = []

    class FakeGateway(gateway_pb2_grpc.GatewayServicer):
        async def Generate(self, request, context):  # the proto's method name
            seen.append(request)
            if request.model == "full":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
            await asyncio.sleep(TTFT_DELAY)
            n = request.sampling.max_tokens
            for i in range(0, n, 2):  # two tokens per message; the first text held back
                if i:
                    await asyncio.sleep(ITL_DELAY)
                ids = list(range(i, min(i + 2, n)))
                last = i + 2 >= n
                yield gateway_pb2.GenerateResponse(
                    text="" if i == 0 else "xy",
                    token_ids=ids,
                    usage=gateway_pb2.Usage(prompt_tokens=7, completion_tokens=n) if last else None,
                )

    async def go():
        server = grpc.aio.server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(FakeGateway(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with GatewayGRPCClient(f"127.0.0.1:{port}") as client:
                ok = [await client.run(_req(0, 5)), await client.run(_req(1, 4, chat=True))]
            async with GatewayGRPCClient(f"127.0.0.1:{port}", "full") as client:
                refused = await client.run(_req(2, 4))
        finally:
            await server.stop(None)
        return ok, refused

    ok, refused = asyncio.run(go())
    assert seen[0].text == "hello there" and seen[0].sampling.ignore_eos
    assert seen[0].sampling.max_tokens == 5 and seen[0].model == ""
    assert [m.role for m in seen[1].chat.messages] == ["system", "user"]
    for rec, n in zip(ok, (5, 4)):
        assert rec.ok and rec.status == "OK", rec.error
        assert rec.chunk_count == (n + 1) // 2  # one arrival per message
        assert rec.output_tokens == n and rec.usage_prompt_tokens == 7
        assert rec.first_token_time - rec.send_time >= TTFT_DELAY - 0.01
    assert refused.status == "RESOURCE_EXHAUSTED" and "queue full" in refused.error
