"""pdserve's shared engine: model loading, the Llama-family forward pass over a paged KV
cache, the block pool, attention backends, the sampler and the continuous-batching
scheduler. Nothing here knows about gRPC."""
