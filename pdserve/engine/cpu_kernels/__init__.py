"""CPU kernels in plain C, compiled once with the system compiler (at install: the Makefile
runs `python -m pdserve.engine.cpu_kernels.build`; else at first use) and called through
ctypes behind typed torch ops (no torch headers, so a build takes seconds, not minutes).

`build` compiles and caches the library, `library` loads it and registers the ops
(`torch.ops.pdserve.*`); `paged_decode` / `paged_prefill` are the attention ops and
`layer_ops` the element-wise layer ops, `crc_copy` a copy fused with its CRC-32C (the shm
KV sender's), `kv_ingest` the copy of received KV into the cache fused with the same CRC-32C
check; `common.h` holds what the .c files share.
Nothing is imported here, so `python -m pdserve.engine.cpu_kernels.build` runs the module
exactly once.
"""
