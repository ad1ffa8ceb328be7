"""The OpenAI-compatible HTTP face of the gateway (aiohttp, on the gRPC server's loop):
/v1/completions, /v1/chat/completions (SSE streaming when asked), /v1/models, /health,
/metrics. Errors use OpenAI's JSON shape with the kind's HTTP status."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import Any

from aiohttp import web

from pdserve.gateway.errors import GatewayError
from pdserve.gateway.openai_protocol import (
    OpenAIRequest,
    Renderer,
    decode_body,
    error_json,
    parse_chat,
    parse_completion,
)
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.prompts import PromptProcessor
from pdserve.gateway.registry import Role, WorkerRegistry
from pdserve.gateway.request import GenerationDelta
from pdserve.metrics import CONTENT_TYPE, TierMetrics

log = logging.getLogger("pdserve.gateway")

MAX_BODY_BYTES = 64 * 2**20


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
                 is_serving: Callable[[], bool]) -> None:
        self.prompts = prompts
        self.orchestrator = orchestrator
        self.registry = registry
        self.metrics = metrics
        self.is_serving = is_serving
        tok = prompts.tokenizer
        self._token_text = lru_cache(maxsize=65536)(
            (lambda t: tok.decode([t])) if tok is not None else str)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
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
        try:
            oreq = parse(decode_body(await request.read()),
                         request.headers.get("X-Request-Timeout"))
            p = self.prompts
            p.check_model(oreq.model)
            if oreq.chat:
                ids, param = p.render_chat(oreq.messages), "messages"
            elif oreq.prompt_text is not None:
                ids, param = p.encode_text(oreq.prompt_text), "prompt"
            else:
                ids, param = list(oreq.prompt_token_ids or ()), "prompt"
            req = p.request(oreq.request_id, ids, oreq.sampling, oreq.stop, oreq.priority,
                            oreq.timeout_s, prompt_param=param, arrival=arrival)
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
        d: GenerationDelta | None = first
        is_first = True
        try:
            while d is not None:
                await resp.write(_sse(render.chunk(d, is_first)))
                is_first = False
                if d.finished:
                    if render.req.include_usage and d.usage is not None:
                        await resp.write(_sse(render.usage_chunk(d.usage)))
                    break
                d = await anext(deltas, None)
        except GatewayError as e:  # headers are sent: the error goes in the stream
            await resp.write(_sse(error_json(e)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
