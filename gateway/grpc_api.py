"""The gRPC face of the gateway for clients: `pdserve.v1.Gateway`. Translates messages to
the gateway's dataclasses and back; the work is the orchestrator's. The worker registry
has its own service on its own listener (registry_api.py)."""

from __future__ import annotations

import contextlib
import time

import grpc

from pdserve.gateway.convert import (
    logprobs_to_proto,
    timing_to_proto,
)
from pdserve.gateway.errors import GatewayError, invalid
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.prompts import Prompt, PromptProcessor
from pdserve.gateway.registry import Role, WorkerRegistry
from pdserve.gateway.request import GenerationRequest
from pdserve.protocol import (
    MAX_TIMEOUT_S,
    STOP,
    ProtocolError,
    check_timeout,
    finish_to_proto,
    proto_fields,
)
from pdserve.protos.pdserve.v1 import gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, prompts: PromptProcessor, orchestrator: Orchestrator,
                 registry: WorkerRegistry) -> None:
        self.prompts = prompts
        self.orchestrator = orchestrator
        self.registry = registry

    async def build_request(self, msg: gateway_pb2.GenerateRequest,
                            call_remaining_s: float | None) -> GenerationRequest:
        """GatewayError(INVALID) for a bad request."""
        arrival = time.monotonic()
        p = self.prompts
        p.check_model(msg.model)
        kind = msg.WhichOneof("prompt")
        param = {"chat": "chat", "token_ids": "token_ids"}.get(kind or "", "text")
        if kind == "chat":
            prompt = Prompt(param, messages=tuple({"role": m.role, "content": m.content}
                                                  for m in msg.chat.messages))
        elif kind == "token_ids":
            prompt = Prompt(param, token_ids=tuple(msg.token_ids.ids))
        else:
            prompt = Prompt(param, text=msg.text)
        ids = await p.prompt_ids(prompt)
        timeout = msg.timeout_s if msg.HasField("timeout_s") else None
        if timeout == 0:
            timeout = None  # the proto says: 0 means none
        try:
            timeout = check_timeout(timeout)
        except ProtocolError as e:
            raise invalid(e.message, e.field) from None
        if call_remaining_s is not None:
            # a call deadline further out than the protocol allows is read as the maximum
            call_remaining_s = min(call_remaining_s, MAX_TIMEOUT_S)
            timeout = call_remaining_s if timeout is None else min(timeout, call_remaining_s)
        return p.request(msg.request_id or None, ids, proto_fields(msg.sampling),
                         stop=list(msg.stop), priority=msg.priority, timeout_s=timeout,
                         prompt_param=param, arrival=arrival)

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        try:
            req = await self.build_request(request, context.time_remaining())
            async with contextlib.aclosing(self.orchestrator.generate(req)) as deltas:
                async for d in deltas:
                    out = gateway_pb2.GenerateResponse(
                        request_id=req.request_id, text=d.text, token_ids=d.token_ids,
                        logprobs=logprobs_to_proto(d.logprobs))
                    if d.finished:
                        out.finish_reason = finish_to_proto(d.finish_reason or STOP)
                        if d.usage is not None:
                            out.usage.CopyFrom(gateway_pb2.Usage(
                                prompt_tokens=d.usage.prompt_tokens,
                                completion_tokens=d.usage.completion_tokens,
                                cached_prompt_tokens=d.usage.cached_prompt_tokens))
                        if d.timing is not None:
                            out.timing.CopyFrom(timing_to_proto(d.timing))
                    yield out
        except GatewayError as e:
            if e.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", f"{e.retry_after_s:g}"),))
            await context.abort(e.kind.grpc_code, e.message)

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        card = self.prompts.card
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelInfo(
            id=card.model_id, max_context_tokens=card.max_context_tokens,
            num_prefill_workers=len(self.registry.alive(Role.PREFILL)),
            num_decode_workers=len(self.registry.alive(Role.DECODE)))])
