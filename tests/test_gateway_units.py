"""Gateway policy without a network: admission, routing, registry, stop strings,
detokenization across multi-byte characters, OpenAI body parsing and validation."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.addresses import addresses
from pdserve.engine.block_hash import block_hashes
from pdserve.engine.detokenizer import window_decoder
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.gateway.admission import AdmissionController, Overloaded
from pdserve.gateway.errors import ErrorKind, GatewayError
from pdserve.gateway.openai_protocol import decode_body, parse_chat, parse_completion
from pdserve.gateway.output import StopMatcher, TextOutput
from pdserve.gateway.prompts import PromptProcessor
from pdserve.gateway.registry import Load, Role, WorkerRegistry
from pdserve.gateway.router import disaggregate, prefix_overlap, rank_decode, rank_prefill

SPEC = KVCacheSpec(2, 64, 16, 2, 16, "float32")


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


# -- admission --------------------------------------------------------------------------------
def test_admission_priority_order_and_queue_bound():
    async def main():
        a = AdmissionController(max_inflight=1, max_queue=5)
        await a.acquire()
        order: list[str] = []

        async def wait(name: str, prio: int) -> None:
            await a.acquire(prio)
            order.append(name)

        tasks = [asyncio.create_task(wait(n, p)) for n, p in
                 (("low1", 5), ("high", 0), ("low2", 5), ("low3", 5), ("high2", 0))]
        await asyncio.sleep(0)
        assert a.stats().queued == 5
        # one bound for all priorities: neither an old nor a new priority buys room
        for prio in (5, 0, -7, 12345):
            with pytest.raises(Overloaded) as e:
                await a.acquire(prio)
            assert e.value.retry_after_s >= 1
        assert a.stats().queued == 5
        for _ in range(5):
            a.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["high", "high2", "low1", "low2", "low3"]
        a.release()
        assert a.stats().inflight == 0 and a.stats().queued == 0
    asyncio.run(main())


def test_admission_deadline_and_cancel_leave_the_queue():
    async def main():
        a = AdmissionController(max_inflight=1, max_queue=4)
        await a.acquire()
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await a.acquire(0, deadline=loop.time() + 0.02)
        t = asyncio.create_task(a.acquire(0))
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert a.stats().queued == 0
        a.release()
        assert a.stats().inflight == 0
        async with a.slot():
            assert a.stats().inflight == 1
        assert a.stats().inflight == 0
    asyncio.run(main())


# -- registry ---------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_registry_heartbeat_timeout_and_static_workers():
    clock = Clock()
    r = WorkerRegistry(heartbeat_timeout_s=3.0, clock=clock)
    r.register("d1", Role.DECODE, "127.0.0.1:1", "m", SPEC, Load(free_blocks=10))
    assert [w.worker_id for w in r.alive(Role.DECODE)] == ["d1"]
    clock.t += 2.0
    assert r.heartbeat("d1", Load(free_blocks=7))
    clock.t += 2.5
    assert r.alive(Role.DECODE)[0].load.free_blocks == 7
    clock.t += 1.0  # 3.5 s of silence: no traffic even before the sweep
    assert r.alive(Role.DECODE) == []
    assert [w.worker_id for w in r.expire()] == ["d1"]
    assert not r.heartbeat("d1", Load())  # the worker must re-register
    s = r.add_static(Role.PREFILL, "127.0.0.1:2")
    assert r.alive(Role.PREFILL) == []  # not routable until its Stats answer
    r.observe(s.worker_id, "m", SPEC, Load(queue_depth=1))
    assert r.alive(Role.PREFILL)[0].load.queue_depth == 1
    r.register("p-real", Role.PREFILL, "127.0.0.1:2", "m", SPEC, Load())
    assert [w.worker_id for w in r.alive(Role.PREFILL)] == ["p-real"]  # one per address
    assert r.deregister("p-real") and not r.deregister("p-real")
    assert addresses("a:1, b:2,") == ["a:1", "b:2"]
    with pytest.raises(ValueError):
        addresses("nohost")


# -- routing ----------------------------------------------------------------------------------
def test_router_decode_prefers_room_then_fewest_blocks_in_use():
    r = WorkerRegistry(5.0)
    r.register("a", Role.DECODE, "h:1", "m", SPEC,
               Load(num_running=4, free_blocks=30, total_blocks=64))
    r.register("b", Role.DECODE, "h:2", "m", SPEC,
               Load(num_running=1, free_blocks=40, total_blocks=64))
    r.register("c", Role.DECODE, "h:3", "m", SPEC,
               Load(num_running=0, free_blocks=1, total_blocks=64))
    ws = r.alive(Role.DECODE)
    assert [w.worker_id for w in rank_decode(ws, 100, {})] == ["b", "a", "c"]
    # requests this gateway just sent count before the next heartbeat shows them
    assert next(w.worker_id for w in rank_decode(ws, 100, {"b": 4})) == "a"


def test_router_prefill_prefix_overlap_and_queue_depth():
    prompt = list(range(100, 164))  # 4 blocks of 16
    hashes = block_hashes(prompt, 16)
    assert prefix_overlap(hashes, frozenset(hashes[:3])) == 3
    assert prefix_overlap(hashes, frozenset(hashes[1:])) == 0  # leading blocks only
    r = WorkerRegistry(5.0)
    r.register("cold", Role.PREFILL, "h:1", "m", SPEC, Load())
    r.register("warm", Role.PREFILL, "h:2", "m", SPEC,
               Load(cached_block_hashes=frozenset(hashes[:3])))
    ws = r.alive(Role.PREFILL)
    assert rank_prefill(ws, prompt, {})[0].worker_id == "warm"
    r.register("warm", Role.PREFILL, "h:2", "m", SPEC,
               Load(queue_depth=2, cached_block_hashes=frozenset(hashes[:3])))
    assert rank_prefill(r.alive(Role.PREFILL), prompt, {})[0].worker_id == "cold"
    assert disaggregate(10, 0, 1) and not disaggregate(10, 0, 0)
    assert not disaggregate(10, 32, 2) and disaggregate(32, 32, 2)


# -- output text ------------------------------------------------------------------------------
def test_stop_strings_spanning_deltas():
    m = StopMatcher(["END", "xyz"])
    out = [m.feed(d) for d in ["hello E", "N", "D tail"]]
    assert "".join(out) == "hello " and m.stopped
    m = StopMatcher(["END"])
    assert m.feed("abc E") == "abc " and m.feed("x") == "Ex" and m.flush() == ""
    m = StopMatcher(["ab"])
    assert m.feed("a") == "" and m.flush() == "a"  # a tail that never completed is kept


def test_detokenizer_never_splits_multibyte_characters(tokenizer):
    text = "Emoji 🤖🎉 and CJK 你好世界, ünïcödé done."
    ids = tokenizer.encode(text)
    out = TextOutput(tokenizer, [], [])
    deltas = [out.add([t]) for t in ids]
    deltas.append(out.finish())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_window_decoder_is_the_backend_where_decode_would_return_the_same(tokenizer):
    import random

    rng = random.Random(0)
    special = sorted(tokenizer.all_special_ids)
    assert tokenizer.clean_up_tokenization_spaces is False  # SmolLM2's: the backend path
    for skip in (True, False):
        fast = window_decoder(tokenizer, skip)
        for _ in range(300):  # windows as the detokenizer decodes them, specials mixed in
            ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(49152)
                   for _ in range(rng.randint(1, 12))]
            assert fast(ids) == tokenizer.decode(ids, skip_special_tokens=skip)

    class CleansSpaces:  # a tokenizer whose decode post-processes: its own decode is used
        backend_tokenizer = tokenizer.backend_tokenizer
        clean_up_tokenization_spaces = True

        def decode(self, ids, skip_special_tokens):
            return "cleaned"

    assert window_decoder(CleansSpaces(), True)([1, 2]) == "cleaned"


def test_stop_string_across_token_boundaries(tokenizer):
    text = "The answer is forty-two. ### Next question"
    ids = tokenizer.encode(text)
    out = TextOutput(tokenizer, [], ["two. ###"])
    got = ""
    for t in ids:
        got += out.add([t])
        if out.stopped:
            break
    assert out.stopped and got == "The answer is forty-"


# -- validation -------------------------------------------------------------------------------
def test_prompt_processor_validation(tokenizer):
    p = PromptProcessor("/models/tiny-llama", tokenizer, 64, 49152, 16)
    p.check_model("tiny-llama")
    p.check_model("/models/tiny-llama")
    with pytest.raises(GatewayError) as e:
        p.check_model("gpt-4")
    assert e.value.kind is ErrorKind.UNKNOWN_MODEL and e.value.param == "model"

    def err(fields=None, ids=(1, 2, 3), **kw) -> GatewayError:
        with pytest.raises(GatewayError) as e:
            p.request(None, list(ids), fields or {}, **kw)
        return e.value

    assert err(ids=()).param == "prompt"
    assert err(ids=range(64)).param == "prompt"
    assert err(ids=(1, 49152)).param == "prompt"
    assert err({"max_tokens": 0}).param == "max_tokens"
    assert err({"max_tokens": 10**9}).param == "max_tokens"
    assert err({"temperature": -1.0}).param == "temperature"
    assert err({"top_p": 2.0}).param == "top_p"
    # types are the validator's too: the OpenAI parser passes sampling fields through
    assert err({"temperature": "hot"}).param == "temperature"
    assert err({"top_k": 2.5}).param == "top_k"
    assert err({"ignore_eos": "yes"}).param == "ignore_eos"
    assert err({"stop_token_ids": [10**6]}).param == "stop_token_ids"
    assert err(timeout_s=-1.0).param == "timeout"
    r = p.request(None, [1, 2, 3], {"top_k": 0}, stop=["x", ""])
    assert r.params.max_tokens == 16 and r.params.top_k == -1 and r.stop == ("x",)
    assert p.request(None, [1] * 60, {}).params.max_tokens == 4  # the context left


def test_openai_parsing():
    with pytest.raises(GatewayError) as e:
        decode_body(b'{"prompt": "\xff"}')
    assert e.value.param == "body" and "UTF-8" in e.value.message
    with pytest.raises(GatewayError) as e:
        decode_body(b'{"prompt": ')
    assert e.value.param == "body" and "JSON" in e.value.message
    with pytest.raises(GatewayError) as e:
        parse_completion({"prompt": "hi", "n": 2})
    assert e.value.param == "n"
    with pytest.raises(GatewayError) as e:
        parse_completion({"prompt": ["a", "b"]})
    assert e.value.param == "prompt"
    r = parse_completion({"prompt": [[5, 6]], "stop": "x", "logprobs": 2, "stream": True,
                          "stream_options": {"include_usage": True}, "top_k": 3,
                          "ignore_eos": True}, timeout_header="2.5")
    assert r.prompt_token_ids == (5, 6) and r.stop == ("x",) and r.include_usage
    assert r.sampling["logprobs"] == 2 and r.timeout_s == 2.5 and r.sampling["top_k"] == 3
    c = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                    "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 7})
    assert c.messages[0]["content"] == "a" and c.sampling["logprobs"] == 3
    assert c.sampling["max_tokens"] == 7
    with pytest.raises(GatewayError) as e:
        parse_chat({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2})
    assert e.value.param == "top_logprobs"


# -- token stream liveness --------------------------------------------------------------------
def test_token_stream_stall_is_unavailable_but_a_slow_reader_is_not():
    """A worker that stops sending mid-stream: UNAVAILABLE once a read has waited the idle
    bound, its call cancelled; a reader that is itself slow between messages is not a
    stall (only a read's own wait counts)."""
    import grpc

    from pdserve.gateway.inflight import InFlight
    from pdserve.gateway.orchestrator import Orchestrator
    from pdserve.gateway.registry import Worker
    from pdserve.protos.pdserve.v1 import decode_pb2

    idle = 0.3

    async def tokens(request: bytes, context):
        for i in range(3):
            yield decode_pb2.TokenChunk(token_ids=[i]).SerializeToString()
            if request == b"stall" and i == 1:
                await asyncio.sleep(30)  # stops sending: the gateway must give up

    async def main():
        srv = grpc.aio.server()
        srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.Tokens", {"Get": grpc.unary_stream_rpc_method_handler(tokens)}),))
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        orch = Orchestrator(None, None, None, None, None, stream_idle_s=idle)
        w = Worker("d", Role.DECODE, f"127.0.0.1:{port}", "m", SPEC, Load(), 0.0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                get = ch.unary_stream("/t.Tokens/Get",
                                      response_deserializer=decode_pb2.TokenChunk.FromString)
                slow = []
                async for c in orch._chunks(get(b"slow"), InFlight().open(w)):
                    slow.append(list(c.token_ids))
                    await asyncio.sleep(2 * idle)  # the reader away, not the worker
                call = get(b"stall")
                got, t0 = [], time.monotonic()
                with pytest.raises(GatewayError) as e:
                    async for c in orch._chunks(call, InFlight().open(w)):
                        got.append(list(c.token_ids))
                waited = time.monotonic() - t0
                return slow, got, e.value, call.cancelled(), waited
        finally:
            await srv.stop(None)

    slow, got, err, cancelled, waited = asyncio.run(main())
    assert slow == [[0], [1], [2]]
    assert got == [[0], [1]] and err.kind is ErrorKind.UNAVAILABLE
    assert "sent nothing for 0.3s" in err.message and cancelled
    assert idle <= waited < idle + 2.0
