"""Benchmark clients: send one `BenchRequest`, stream the answer, time every token.

A request's life in a client (`BenchClient.run`):

1. `send_time` is taken just before the request goes out (connection set-up included, as a
   real client would pay it);
2. every streamed message that carries output text is one token arrival: its receive time
   is appended to `token_times` (the first one is `first_token_time`);
3. the stream ends (`end_time`) normally, with an error (`error` set, `status` holding the
   HTTP status or gRPC status name), or at the caller's timeout (`error` says so; the
   partial timings are kept).

`run` never raises for a failed request: every request ends in a `RequestRecord`.
Times are `time.perf_counter()` seconds; `pdserve.bench.metrics` makes them relative.

Servers may pack several tokens into one streamed message; `chunk_count` counts messages,
`usage_output_tokens` is the server's own count (OpenAI `usage`, final message), and
`output_tokens` prefers the latter.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from pdserve.bench.workloads import BenchRequest

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass
class RequestRecord:
    """What one request did, as seen by the client."""

    request_id: int
    prompt_tokens: int  # the workload's count; `usage_prompt_tokens` is the server's
    expected_output_tokens: int
    arrival_s: float = 0.0  # scheduled offset from the run start
    send_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per token-bearing message
    end_time: float | None = None
    chunk_count: int = 0
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    error: str | None = None
    status: int | str | None = None  # HTTP status code or gRPC status name

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage count when it sent one, else chunks."""
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return self.chunk_count

    def add_token_event(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        self.chunk_count += 1


class BenchClient(ABC):
    """Sends requests to one server. Subclasses implement `_stream`; use as an async
    context manager (or call `close`) so connections are released."""

    async def run(self, req: BenchRequest, timeout: float | None = None) -> RequestRecord:
        """Send `req`, stream to the end (or `timeout` seconds), and return its record."""
        rec = RequestRecord(
            request_id=req.request_id,
            prompt_tokens=req.prompt_tokens,
            expected_output_tokens=req.output_tokens,
            arrival_s=req.arrival_s,
        )
        rec.send_time = time.perf_counter()
        try:
            await asyncio.wait_for(self._stream(req, rec), timeout)
        except asyncio.TimeoutError:
            rec.error = rec.error or f"timeout after {timeout:.3g}s"
        except Exception as exc:  # noqa: BLE001 - a failed request is data, not a crash
            rec.error = rec.error or f"{type(exc).__name__}: {exc}"
        rec.end_time = time.perf_counter()
        if rec.error is None and rec.chunk_count == 0:
            rec.error = "stream ended without output tokens"
        return rec

    @abstractmethod
    async def _stream(self, req: BenchRequest, rec: RequestRecord) -> None:
        """Send `req` and fill `rec` in place: `status`, `add_token_event` per token-bearing
        message, usage counts, and `error` for a failure reported by the server."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release connections."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class OpenAIHTTPClient(BenchClient):
    """Any OpenAI-compatible server: `/v1/completions` or `/v1/chat/completions`, streamed.

    `endpoint="auto"` sends prompt requests to completions and chat requests to chat;
    `"chat"` wraps a prompt as a single user message (the chat template's tokens then come
    on top of the request's `prompt_tokens`); `"completions"` refuses chat
    requests. `extra_body` is merged into every request body (e.g. `{"temperature": 0}`).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        endpoint: str = "auto",
        api_key: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        if endpoint not in ("auto", "completions", "chat"):
            raise ValueError(f"endpoint must be auto, completions or chat, not {endpoint!r}")
        base = base_url.rstrip("/")
        self.base_url = base.removesuffix("/v1")
        self.model = model
        self.endpoint = endpoint
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.extra_body = dict(extra_body or {})
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connector limit: the runner bounds concurrency; no read timeout: `run` has one.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def build_request(self, req: BenchRequest) -> tuple[str, dict[str, Any]]:
        """The URL and JSON body for `req`."""
        chat = req.is_chat if self.endpoint == "auto" else self.endpoint == "chat"
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if chat:
            messages = req.messages or ()
            body["messages"] = (
                [m.to_json() for m in messages]
                if req.messages is not None
                else [{"role": "user", "content": req.prompt}]
            )
            url = f"{self.base_url}/v1/chat/completions"
        else:
            if req.prompt is None:
                raise ValueError("chat request sent to the completions endpoint")
            body["prompt"] = req.prompt
            url = f"{self.base_url}/v1/completions"
        body.update(self.extra_body)
        return url, body

    async def _stream(self, req: BenchRequest, rec: RequestRecord) -> None:
        url, body = self.build_request(req)
        async with self._get_session().post(url, json=body, headers=self.headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                rec.error = f"HTTP {resp.status}: {text[:300]}"
                return
            data_lines: list[str] = []
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode("utf-8").rstrip("\r\n")
                if line:
                    if not line.startswith(":"):  # ":" starts an SSE comment
                        name, _, value = line.partition(":")
                        if name == "data":
                            data_lines.append(value.removeprefix(" "))
                    continue
                if data_lines:  # a blank line ends the event
                    done = self._on_event("\n".join(data_lines), rec)
                    data_lines = []
                    if done:
                        return
            if data_lines:
                self._on_event("\n".join(data_lines), rec)

    @staticmethod
    def _on_event(data: str, rec: RequestRecord) -> bool:
        """Apply one SSE `data` payload to `rec`; True when the stream is over."""
        now = time.perf_counter()
        if data.strip() == "[DONE]":
            return True
        obj = json.loads(data)
        if obj.get("error"):
            err = obj["error"]
            rec.error = f"server error: {err.get('message', err) if isinstance(err, dict) else err}"
            return True
        usage = obj.get("usage")
        if usage:
            rec.usage_prompt_tokens = usage.get("prompt_tokens", rec.usage_prompt_tokens)
            rec.usage_output_tokens = usage.get("completion_tokens", rec.usage_output_tokens)
        for choice in obj.get("choices") or ():
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                rec.add_token_event(now)
        return False


class GatewayGRPCClient(BenchClient):
    """pdserve's gRPC gateway: server-streaming `pdserve.v1.Gateway/Generate`.

    A response message with token ids is one token arrival (its ids may be several tokens;
    `text` may be empty while the gateway holds back a partial character, which still
    counts). The last message's `usage` is the server's count; without it, the streamed
    ids are. A failed call records the gRPC status name (`UNAVAILABLE`, ...) in `status`.
    `model=""` selects the gateway's default model. The stubs are imported on first use.
    """

    def __init__(self, address: str, model: str = "") -> None:
        self.address = address
        self.model = model
        self._channel: Any = None
        self._stub: Any = None

    def _get_stub(self) -> Any:
        if self._stub is None:
            import grpc

            from pdserve.protos.pdserve.v1 import gateway_pb2_grpc

            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    def build_request(self, req: BenchRequest) -> Any:
        """The `GenerateRequest` for `req`."""
        from pdserve.protos.pdserve.v1 import common_pb2, gateway_pb2

        sampling = common_pb2.SamplingParams(max_tokens=req.output_tokens, ignore_eos=True)
        if req.messages is not None:
            chat = gateway_pb2.ChatMessages(
                messages=[
                    gateway_pb2.ChatMessage(role=m.role, content=m.content) for m in req.messages
                ]
            )
            return gateway_pb2.GenerateRequest(model=self.model, chat=chat, sampling=sampling)
        return gateway_pb2.GenerateRequest(model=self.model, text=req.prompt, sampling=sampling)

    async def _stream(self, req: BenchRequest, rec: RequestRecord) -> None:
        import grpc

        call = self._get_stub().Generate(self.build_request(req))
        streamed = 0
        try:
            async for msg in call:
                now = time.perf_counter()
                if msg.token_ids:
                    streamed += len(msg.token_ids)
                    rec.add_token_event(now)
                if msg.HasField("usage"):
                    rec.usage_prompt_tokens = msg.usage.prompt_tokens
                    rec.usage_output_tokens = msg.usage.completion_tokens
            rec.status = "OK"
            if rec.usage_output_tokens is None:
                rec.usage_output_tokens = streamed
        except grpc.aio.AioRpcError as exc:
            rec.status = exc.code().name
            rec.error = f"{exc.code().name}: {exc.details()}"
        finally:
            call.cancel()  # no-op when the call already ended; frees it on timeout
