"""DecodeWorker.Session: many requests' token streams on one call (decode_worker/session.py,
gateway/decode_session.py), against real decode and prefill workers on loopback.

- Streams on one session carry, token for token, what their own calls carry, and chunks of
  one step for several streams travel in one message.
- Each stream ends as its call would: INVALID_ARGUMENT, NOT_FOUND, DEADLINE_EXCEEDED (its
  request aborted, its blocks freed), a cancelled stream aborts its request and leaves the
  others going; a reserved (disaggregated) stream waits for its KV like Decode does.
- A worker refusing new colocated work refuses a Generate stream UNAVAILABLE; a stopping
  worker refuses new streams, finishes the open ones, then ends the session; a session
  that broke fails its streams UNAVAILABLE and the next stream opens a new one.
- A worker without the Session method gets a call per request, the streams already opened
  included.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from conftest import assert_pool_clean
from test_disagg import _all_blocks_free, _start

from pdserve.gateway.channels import WorkerChannels
from pdserve.gateway.decode_session import TokenStream
from pdserve.protocol import SamplingParams
from pdserve.protos.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)


def _prompt(i: int, n: int = 20) -> list[int]:
    return [(31 * i + 7 * j) % 3000 + 60 for j in range(n)]


def _generate(i: int, params: SamplingParams = GREEDY, prompt: list[int] | None = None
              ) -> decode_pb2.ColocatedGenerateRequest:
    return decode_pb2.ColocatedGenerateRequest(
        request_id=f"r{i}", prompt_token_ids=prompt or _prompt(i), sampling=params.to_proto())


async def _tokens(stream) -> tuple[list[int], decode_pb2.TokenChunk]:
    ids: list[int] = []
    last = None
    while (ch := await stream.read()) is not grpc.aio.EOF:
        ids.extend(ch.token_ids)
        last = ch
    return ids, last


async def _status(stream) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _tokens(stream)
    return e.value


@contextlib.asynccontextmanager
async def _decode_worker(model_dir: str) -> AsyncIterator[tuple[object, WorkerChannels]]:
    """A real decode worker and a gateway's channels to it; its pool must end clean."""
    dec = await _start("decode", model_dir)
    channels = WorkerChannels()
    try:
        yield dec, channels
    finally:
        await channels.close_all()
        await dec.stop(0)
    assert_pool_clean(dec.engine)


def test_streams_on_one_session_equal_their_own_calls_and_share_messages(tiny_model_dir):
    async def main():
        dec = await _start("decode", tiny_model_dir)
        try:
            per_call = WorkerChannels(sessions=False)
            want = [(await _tokens(per_call.token_stream(dec.address, _generate(i), None)))[0]
                    for i in range(4)]
            await per_call.close_all()
            assert all(len(w) == GREEDY.max_tokens for w in want)

            async with grpc.aio.insecure_channel(dec.address) as ch:
                opens = [decode_pb2.SessionUp(stream_id=10 + i, generate=_generate(i))
                         for i in range(4)]

                async def ups():
                    for up in opens:
                        yield up
                    await asyncio.sleep(3600)  # the gateway keeps its side open

                got: dict[int, list[int]] = {}
                ended: dict[int, decode_pb2.SessionEntry] = {}
                widest = 0
                call = decode_pb2_grpc.DecodeWorkerStub(ch).Session(ups(), timeout=60)
                async for down in call:
                    widest = max(widest, len({e.stream_id for e in down.entries}))
                    for e in down.entries:
                        got.setdefault(e.stream_id, []).extend(e.chunk.token_ids)
                        if e.end:
                            ended[e.stream_id] = e
                    if len(ended) == 4:
                        break
                call.cancel()
            assert [got[10 + i] for i in range(4)] == want
            for e in ended.values():  # the last chunk carries the end, status OK
                assert e.status_code == 0 and e.chunk.finish_reason == \
                    common_pb2.FINISH_REASON_LENGTH
            # the four decode together: one step's four tokens go out in one message
            assert widest >= 2
            assert await _all_blocks_free(dec)
        finally:
            await dec.stop(0)
        assert_pool_clean(dec.engine)

    asyncio.run(main())


def test_each_stream_ends_as_its_call_would(tiny_model_dir):
    async def main():
        async with _decode_worker(tiny_model_dir) as (dec, channels):
            keep = channels.token_stream(dec.address, _generate(1), None)
            doomed = channels.token_stream(dec.address, _generate(2, LONG), None)
            late = channels.token_stream(dec.address, _generate(3, LONG), 0.5)
            bad = channels.token_stream(dec.address, _generate(4, prompt=[10**6]), None)
            unknown = channels.token_stream(
                dec.address, decode_pb2.DecodeRequest(reservation_id="nope"), None)
            assert isinstance(keep, TokenStream)
            assert len({s._session for s in (keep, doomed, late, bad, unknown)}) == 1

            assert (await _status(bad)).code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (await _status(unknown)).code() == grpc.StatusCode.NOT_FOUND
            assert (await _status(late)).code() == grpc.StatusCode.DEADLINE_EXCEEDED

            first = await doomed.read()
            assert list(first.token_ids)
            assert doomed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await doomed.read()
            ids, last = await _tokens(keep)
            assert len(ids) == GREEDY.max_tokens
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            # the cancelled and the timed-out requests were aborted at the worker
            assert await _all_blocks_free(dec)
            assert dec.engine.counters.generation_tokens < 2 * LONG.max_tokens

    asyncio.run(main())


def test_a_reserved_stream_waits_for_its_kv_on_the_session(tiny_model_dir):
    async def main():
        dec = await _start("decode", tiny_model_dir)
        pre = await _start("prefill", tiny_model_dir)
        channels = WorkerChannels()
        try:
            want, _ = await _tokens(channels.token_stream(dec.address, _generate(5), None))
            ids = _prompt(5)
            sp = GREEDY.to_proto()
            async with grpc.aio.insecure_channel(dec.address) as dch, \
                    grpc.aio.insecure_channel(pre.address) as pch:
                res = await decode_pb2_grpc.DecodeWorkerStub(dch).Reserve(
                    decode_pb2.ReserveRequest(request_id="d5", prompt_token_ids=ids,
                                              sampling=sp))
                stream = channels.token_stream(
                    dec.address, decode_pb2.DecodeRequest(reservation_id=res.reservation_id),
                    None)
                await prefill_pb2_grpc.PrefillWorkerStub(pch).Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="d5", prompt_token_ids=ids, sampling=sp,
                        decode_address=dec.address, reservation_id=res.reservation_id,
                        reserved_blocks=res.num_blocks, decode_kv_spec=res.kv_spec,
                        reservation_secret=res.reservation_secret))
                got, last = await _tokens(stream)
            assert got == want
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert await _all_blocks_free(dec)
        finally:
            await channels.close_all()
            await dec.stop(0)
            await pre.stop(0)
        assert_pool_clean(dec.engine)

    asyncio.run(main())


def test_refusals_stopping_and_a_broken_session(tiny_model_dir):
    async def main():
        async with _decode_worker(tiny_model_dir) as (dec, channels):
            # a worker leaving the decode tier refuses new colocated work on a session too
            dec.grpc.services.refuse = (lambda m: "leaving the tier"
                                        if m.endswith("/Generate") else None)
            refused = await _status(channels.token_stream(dec.address, _generate(1), None))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert "leaving the tier" in refused.details()
            dec.grpc.services.refuse = lambda m: None

            # stopping: the open stream finishes, a new one is refused, the session ends
            going = channels.token_stream(dec.address, _generate(2), None)
            first = list((await going.read()).token_ids)
            assert first
            session = going._session
            dec.end_sessions()
            late = await _status(channels.token_stream(dec.address, _generate(3), None))
            assert late.code() == grpc.StatusCode.UNAVAILABLE
            ids, _ = await _tokens(going)
            assert len(first + ids) == GREEDY.max_tokens
            for _ in range(50):
                if session.closed:
                    break
                await asyncio.sleep(0.1)
            assert session.closed
            assert not dec.service._sessions
            # the next stream opens a new session (the worker is not stopping after all)
            again = channels.token_stream(dec.address, _generate(4), None)
            assert again._session is not session
            ids, _ = await _tokens(again)
            assert len(ids) == GREEDY.max_tokens

            # the session breaks under an open stream: UNAVAILABLE, the request aborted
            broken = channels.token_stream(dec.address, _generate(5, LONG), None)
            assert list((await broken.read()).token_ids)
            broken._session.close()
            err = await _status(broken)
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert await _all_blocks_free(dec)

    asyncio.run(main())


async def _generate_two(request, context):
    yield decode_pb2.TokenChunk(token_ids=[5])
    yield decode_pb2.TokenChunk(token_ids=[6], finish_reason=common_pb2.FINISH_REASON_STOP)


def _calls_only_worker() -> grpc.GenericRpcHandler:
    """A worker from before sessions: its DecodeWorker service has Generate and no Session
    method, so the server itself answers a Session call UNIMPLEMENTED."""
    return grpc.method_handlers_generic_handler("pdserve.v1.DecodeWorker", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _generate_two,
            request_deserializer=decode_pb2.ColocatedGenerateRequest.FromString,
            response_serializer=decode_pb2.TokenChunk.SerializeToString)})


def test_a_worker_without_sessions_gets_a_call_per_request():
    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_calls_only_worker(),))
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        channels = WorkerChannels()
        try:
            async with asyncio.timeout(30):
                # both opened before the worker's answer: both are sent again as calls
                a = channels.token_stream(address, _generate(1), 10)
                b = channels.token_stream(address, _generate(2), 10)
                assert (await _tokens(a))[0] == [5, 6]
                assert (await _tokens(b))[0] == [5, 6]
                c = channels.token_stream(address, _generate(3), 10)
                assert not isinstance(c, TokenStream)  # a plain call from now on
                assert (await _tokens(c))[0] == [5, 6]
        finally:
            await channels.close_all()
            await server.stop(0)

    asyncio.run(main())


@pytest.mark.parametrize("sessions", [True, False], ids=["session", "per-request"])
def test_through_the_gateway_either_way(tiny_model_dir, sessions):
    """The gateway's requests, colocated and disaggregated, give the engine's tokens over
    sessions and over a call per request (`--decode-streams`); only the first opens
    sessions at the worker."""
    import openai
    from conftest import tiny_engine
    from test_gateway_support import Cluster

    prompts = ["Hello", "In a distant galaxy, far beyond the reach of any telescope, lived"]
    eng = tiny_engine(tiny_model_dir, num_threads=1)
    ids = [eng.tokenizer.encode(p) for p in prompts]
    want = [eng.tokenizer.decode(o.token_ids, skip_special_tokens=True)
            for o in eng.generate(ids, GREEDY)]
    assert len(ids[0]) < 8 <= len(ids[1])  # one colocated, one disaggregated
    c = Cluster(tiny_model_dir, disagg_threshold=8, decode_sessions=sessions)
    try:
        c.add_worker("prefill")
        dec = c.add_worker("decode")
        oai = openai.OpenAI(base_url=c.base_url, api_key="none", max_retries=0)
        for p, w in zip(prompts, want):
            stream = oai.completions.create(model=tiny_model_dir, prompt=p, stream=True,
                                            max_tokens=GREEDY.max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert "".join(ch.choices[0].text for ch in stream if ch.choices) == w
        assert bool(dec.service._sessions) == sessions
        c.assert_no_leaks()
    finally:
        c.close()
