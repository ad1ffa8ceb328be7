"""Attention backends, one per module, implementing pdserve.engine.layers.attention's
interface: `torch` (the references), `cpu` (the C kernels), `triton` (the Triton kernels).
Chosen by name through pdserve.engine.layers.registry.get_backend; nothing is imported
here, so a backend's dependencies load only when it is chosen.
"""
