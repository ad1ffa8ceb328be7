"""CPU kernels in plain C, compiled with the system compiler at first use and called
through ctypes (no torch headers, so a build takes about a second, not minutes).

`build` compiles and caches the library; `paged_decode` loads it and launches the paged
decode-attention kernel. Nothing is imported here, so `python -m
engine.cpu_kernels.build` runs the module exactly once.
"""
