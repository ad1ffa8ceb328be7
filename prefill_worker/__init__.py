"""The prefill tier: a gRPC worker that computes prompts (batched, chunked, prefix-cached),
samples each one's first token and pushes its KV to the decode worker that reserved it."""
