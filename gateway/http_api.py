"""The OpenAI-compatible HTTP face of the gateway (aiohttp, on the gRPC server's loop):
/v1/completions, /v1/chat/completions (SSE streaming when asked), /v1/models, /health,
/metrics. Errors use OpenAI's JSON shape with the kind's HTTP status.

Admission before work: a body over `max_body_bytes` is refused with 413 before it is read;
JSON is depth-checked, parsed and its prompt tokenized on the prompt processor's thread
pool, never on the event loop (so /health and every stream stay live); a streaming client
that takes no bytes for `write_timeout_s` is dropped and its request cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import Any

from aiohttp import web

from pdserve.gateway.errors import ErrorKind, GatewayError
from pdserve.gateway.openai_protocol import (
    OpenAIRequest,
    Renderer,
    decode_body,
    error_json,
    parse_chat,
    parse_completion,
)
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.prompts import Prompt, PromptProcessor
from pdserve.gateway.registry import Role, WorkerRegistry
from pdserve.gateway.request import GenerationDelta
from pdserve.metrics import CONTENT_TYPE, TierMetrics

log = logging.getLogger("pdserve.gateway")

MAX_BODY_BYTES = 4 * 2**20  # default of --max-body-bytes


def error_response(e: GatewayError) -> web.Response:
    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(e.retry_after_s)))
    return web.json_response(error_json(e), status=e.kind.http_status, headers=headers)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class OpenAIServer:
    def __init__(self, prompts: PromptProcessor, orchestrator: Orchestrator,
                 registry: WorkerRegistry, metrics: TierMetrics,
                 is_serving: Callable[[], bool], max_body_bytes: int = MAX_BODY_BYTES,
                 write_timeout_s: float = 30.0) -> None:
        self.prompts = prompts
        self.max_body_bytes = max_body_bytes
        self.write_timeout_s = write_timeout_s
        self.orchestrator = orchestrator
        self.registry = registry
        self.metrics = metrics
        self.is_serving = is_serving
        tok = prompts.tokenizer
        self._token_text = lru_cache(maxsize=65536)(
            (lambda t: tok.decode([t])) if tok is not None else str)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    # -- simple endpoints -------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.is_serving():
            return web.json_response({"status": "not serving"}, status=503)
        return web.json_response({
            "status": "ok", "prefill_workers": len(self.registry.alive(Role.PREFILL)),
            "decode_workers": len(self.registry.alive(Role.DECODE))})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        card = self.prompts.card
        return web.json_response({"object": "list", "data": [{
            "id": card.model_id, "object": "model", "created": 0, "owned_by": "pdserve",
            "root": card.model_id, "max_model_len": card.max_context_tokens}]})

    # -- generation -------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def _generate(self, request: web.Request,
                        parse: Callable[[dict, str | None], OpenAIRequest]
                        ) -> web.StreamResponse:
        arrival = time.monotonic()
        p = self.prompts
        try:
            body = await self._body(request)
            oreq = parse(body, request.headers.get("X-Request-Timeout"))
            p.check_model(oreq.model)
            if oreq.chat:
                prompt = Prompt("messages", messages=oreq.messages)
            elif oreq.prompt_text is not None:
                prompt = Prompt("prompt", text=oreq.prompt_text)
            else:
                prompt = Prompt("prompt", token_ids=oreq.prompt_token_ids or ())
            req = p.request(oreq.request_id, await p.prompt_ids(prompt), oreq.sampling,
                            oreq.stop, oreq.priority, oreq.timeout_s,
                            prompt_param=prompt.param, arrival=arrival)
        except GatewayError as e:
            return error_response(e)
        render = Renderer(oreq, req.request_id, self.prompts.card.model_id, int(time.time()),
                          self._token_text)
        async with contextlib.aclosing(self.orchestrator.generate(req)) as deltas:
            if oreq.stream:
                return await self._stream(request, deltas, render)
            try:
                out = [d async for d in deltas]
            except GatewayError as e:
                return error_response(e)
            return web.json_response(render.full(out))

    async def _body(self, request: web.Request) -> dict:
        """The JSON body, refused before it is read when it says it is too big, and parsed
        off the event loop."""
        limit = self.max_body_bytes
        too_big = GatewayError(ErrorKind.TOO_LARGE,
                               f"body: larger than this gateway's limit of {limit} bytes",
                               "body")
        if request.content_length is not None and request.content_length > limit:
            raise too_big
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body that kept going
            raise too_big from None
        return await asyncio.get_running_loop().run_in_executor(
            self.prompts.executor, decode_body, raw)

    async def _write(self, resp: web.StreamResponse, data: bytes,
                     transport: asyncio.Transport | None) -> None:
        """A write the client must take within the write timeout (TimeoutError if not).
        A write can wait only once the socket's buffer passes its high-water mark (the
        reader fell behind): below it, the timer a timeout arms and disarms per token is
        skipped."""
        if transport is not None and (transport.get_write_buffer_size() + len(data)
                                      < transport.get_write_buffer_limits()[1]):
            await resp.write(data)
            return
        async with asyncio.timeout(self.write_timeout_s):
            await resp.write(data)

    async def _stream(self, request: web.Request, deltas: AsyncIterator[GenerationDelta],
                      render: Renderer) -> web.StreamResponse:
        # Wait for the first delta before sending headers, so that admission, routing and
        # prefill failures still get their HTTP status.
        try:
            first = await anext(deltas)
        except GatewayError as e:
            return error_response(e)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sock = request.transport
        d: GenerationDelta | None = first
        is_first = True
        try:
            try:
                while d is not None:
                    await self._write(resp, _sse(render.chunk(d, is_first)), sock)
                    is_first = False
                    if d.finished:
                        if render.req.include_usage and d.usage is not None:
                            await self._write(resp, _sse(render.usage_chunk(d.usage)), sock)
                        break
                    d = await anext(deltas, None)
            except GatewayError as e:  # headers are sent: the error goes in the stream
                await self._write(resp, _sse(error_json(e)), sock)
            await self._write(resp, b"data: [DONE]\n\n", sock)
            await resp.write_eof()
        except TimeoutError:
            # a reader this slow would grow our buffers without bound: drop it (leaving
            # `deltas` cancels the request at its worker)
            log.info("request %s: client stopped reading; cancelled", render.id)
            if request.transport is not None:
                request.transport.abort()
        return resp
