"""CPU kernels in plain C, compiled with the system compiler at first use and called
through ctypes (no torch headers, so a build takes about a second, not minutes).

`build` compiles and caches the library, `library` loads it; `paged_decode` launches the
paged decode-attention kernel and `layer_ops` the element-wise layer ops. Nothing is
imported here, so `python -m pdserve.engine.cpu_kernels.build` runs the module exactly once.
"""
