"""The four workloads of the peers comparison, as `pdserve.bench.workloads` builds them.

a  mixed-64 all at t=0 (prompts 32-512, outputs 16-256 tokens, log-uniform; seed 0: 11,326
   prompt and 5,846 output tokens): throughput under a burst. peers.md's earlier run
   reports 17,646 / ~3.4k for its mixed-64, from generator settings it does not record;
   this is `pdserve.bench.workloads.mixed` with its defaults, as `pdserve.bench.offline`
   uses it;
b  fixed 256/128 x 32, all at t=0: throughput at one shape;
c  mixed-64 Poisson at 2 req/s under SLO TTFT 2 s / TPOT 200 ms: latency under load;
d  a single 128/128 request: the unloaded TTFT and TPOT.

Every system gets the same requests (same seed, same tokenizer); a and c share prompts,
which is why prefix caches are reset between workloads where the system allows it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.workloads import BenchRequest, Tokenizer, make_workload, with_arrivals


@dataclass(frozen=True)
class PeerWorkload:
    """One workload: which generator, how many requests, their arrivals and SLOs."""

    key: str
    title: str
    generator: str  # a key of pdserve.bench.workloads.WORKLOADS
    num_requests: int
    rate: float = math.inf  # requests/s, Poisson; inf = all at t=0
    params: Mapping[str, Any] = field(default_factory=dict)
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    def requests(self, tokenizer: Tokenizer, seed: int) -> list[BenchRequest]:
        reqs = make_workload(self.generator, tokenizer, self.num_requests, seed, **self.params)
        return with_arrivals(reqs, self.rate, seed)


WORKLOADS: dict[str, PeerWorkload] = {w.key: w for w in (
    PeerWorkload("a", "mixed-64 at once", "mixed", 64),
    PeerWorkload("b", "fixed 256/128 x 32 at once", "fixed", 32,
                 params={"input_len": 256, "output_len": 128}),
    PeerWorkload("c", "mixed-64 Poisson 2 req/s", "mixed", 64, rate=2.0, ttft_slo_s=2.0,
                 tpot_slo_s=0.2),
    PeerWorkload("d", "single 128/128", "fixed", 1, params={"input_len": 128, "output_len": 128}),
)}
