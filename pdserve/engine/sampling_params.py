"""Sampling parameters: defined once, torch-free, in `pdserve.protocol` (shared with the
gateway and the client); re-exported here for engine code."""

from pdserve.protocol import SamplingParams

__all__ = ["SamplingParams"]
