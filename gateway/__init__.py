"""The gateway: client APIs (gRPC `pdserve.v1.Gateway`, OpenAI-compatible HTTP),
tokenization, admission, routing and the worker registry.

- `server`: `Gateway(GatewayConfig)` — the process (start/stop, ports, housekeeping).
- `orchestrator`: the request life cycle across tiers.
- `admission`, `router`, `registry`: plain-Python policy, unit-tested without a network.
- `inflight`: each worker's calls in flight; a worker the registry drops ends them.
- `prompts`, `output`: tokenization and validation in; detokenization and stop strings out.
- `grpc_api`, `http_api`, `openai_protocol`: the client-facing translations.
"""

from pdserve.gateway.server import Gateway, GatewayConfig

__all__ = ["Gateway", "GatewayConfig"]
