"""PdserveClient: a small asyncio client of the gateway's gRPC API (`pdserve.v1.Gateway`).

    async with PdserveClient("127.0.0.1:50051") as c:
        async for chunk in c.generate("Hello", max_tokens=16, temperature=0):
            print(chunk.text, end="")

Failures raise `grpc.aio.AioRpcError` with the gateway's status (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Self

import grpc

from pdserve.convert import logprobs_from_proto
from pdserve.protocol import TokenLogprobs, finish_from_proto, sampling_proto
from pdserve.protos.pdserve.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class GenerateChunk:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # set on the last chunk
    prompt_tokens: int = 0  # the usage fields are set on the last chunk
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_context_tokens: int
    num_prefill_workers: int
    num_decode_workers: int


class PdserveClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, prompt: str | None = None, *,
                       messages: Sequence[tuple[str, str] | dict] | None = None,
                       token_ids: Sequence[int] | None = None, model: str = "",
                       max_tokens: int | None = None, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None,
                       min_p: float | None = None, seed: int | None = None,
                       repetition_penalty: float | None = None, logprobs: int | None = None,
                       stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                       ignore_eos: bool = False, min_tokens: int = 0, priority: int = 0,
                       timeout: float | None = None, request_id: str = ""
                       ) -> AsyncIterator[GenerateChunk]:
        """Stream a completion of exactly one of `prompt`, `messages` ((role, content)
        pairs or {"role", "content"} dicts) or `token_ids`."""
        if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages, token_ids")
        # unset fields stay unset: the gateway applies the defaults and validates
        sampling = sampling_proto(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, repetition_penalty=repetition_penalty, logprobs=logprobs,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, min_tokens=min_tokens)
        req = gateway_pb2.GenerateRequest(request_id=request_id, model=model,
                                          sampling=sampling, stop=list(stop),
                                          priority=priority)
        if timeout is not None:
            req.timeout_s = timeout
        if prompt is not None:
            req.text = prompt
        elif token_ids is not None:
            req.token_ids.ids.extend(token_ids)
        else:
            for m in messages or ():
                role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
                req.chat.messages.add(role=role, content=content)
        call = self._stub.Generate(req)
        try:
            async for r in call:
                yield GenerateChunk(r.text, tuple(r.token_ids),
                                    finish_from_proto(r.finish_reason),
                                    r.usage.prompt_tokens, r.usage.completion_tokens,
                                    r.usage.cached_prompt_tokens,
                                    tuple(logprobs_from_proto(x) for x in r.logprobs))
        finally:
            call.cancel()  # no-op once the stream ended; tells the gateway when we leave

    async def list_models(self) -> list[ModelInfo]:
        resp = await self._stub.ListModels(gateway_pb2.ListModelsRequest())
        return [ModelInfo(m.id, m.max_context_tokens, m.num_prefill_workers,
                          m.num_decode_workers) for m in resp.models]
