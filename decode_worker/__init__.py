"""The decode tier: a gRPC worker that reserves KV blocks for prompts prefilled elsewhere,
receives their KV, and continuously batches generation; it can also prefill by itself
(colocated mode)."""
