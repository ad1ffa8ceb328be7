"""Attention backends behind one interface; `get_backend(name)` picks one by name."""

from pdserve.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    available_backends,
    get_backend,
    register_backend,
)

__all__ = [
    "AttentionBackend", "AttentionMetadata", "available_backends", "get_backend",
    "register_backend",
]
