"""Routing only between compatible workers (gateway/router.py): a prefill worker is paired
with decode workers of its KV layout only, one that no decode worker can take KV from gets no
prompts, and the decode_address a prefill worker is sent is always a decode worker
registered at the gateway (Orchestrator._check_destination)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.gateway.errors import ErrorKind, GatewayError
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.registry import Load, Role, Worker, WorkerRegistry
from pdserve.gateway.router import decodes_for, kv_compatible, pairable_prefills
from pdserve.metrics import TierMetrics

F32 = KVCacheSpec(2, 64, 16, 2, 16, "float32")
BF16 = dataclasses.replace(F32, dtype="bfloat16")


def _w(wid: str, role: Role, spec: KVCacheSpec | None) -> Worker:
    return Worker(wid, role, f"h:{wid}", "m", spec, Load(), last_seen=0.0)


def test_compatible_means_same_layout_whatever_the_pool_size():
    p = _w("p", Role.PREFILL, F32)
    assert kv_compatible(p, _w("d", Role.DECODE, dataclasses.replace(F32, num_blocks=999)))
    assert not kv_compatible(p, _w("d", Role.DECODE, BF16))
    assert not kv_compatible(p, _w("d", Role.DECODE, dataclasses.replace(F32, block_size=32)))
    assert not kv_compatible(p, _w("d", Role.DECODE, dataclasses.replace(F32, num_layers=3)))
    # a layout not reported yet (static worker before its first Stats) excludes nobody
    assert kv_compatible(p, _w("d", Role.DECODE, None))
    assert kv_compatible(_w("p", Role.PREFILL, None), _w("d", Role.DECODE, BF16))


def test_prefill_paired_only_with_decode_workers_of_its_layout():
    p32, p16 = _w("p32", Role.PREFILL, F32), _w("p16", Role.PREFILL, BF16)
    d32a, d32b = _w("d32a", Role.DECODE, F32), _w("d32b", Role.DECODE, F32)
    d16 = _w("d16", Role.DECODE, BF16)
    decodes = [d32a, d16, d32b]
    assert [d.worker_id for d in decodes_for(p32, decodes)] == ["d32a", "d32b"]
    assert [d.worker_id for d in decodes_for(p16, decodes)] == ["d16"]
    assert [p.worker_id for p in pairable_prefills([p32, p16], decodes)] == ["p32", "p16"]
    # only float32 decode workers alive: the bfloat16 prefill worker gets nothing
    assert [p.worker_id for p in pairable_prefills([p32, p16], [d32a])] == ["p32"]
    # no decode worker can take a prefill worker's KV: none is pairable (all colocated)
    assert pairable_prefills([p16], [d32a, d32b]) == []


def _orchestrator(registry: WorkerRegistry) -> Orchestrator:
    # the destination check reads the registry only: no channels, admission or tokenizer
    return Orchestrator(registry, channels=None, admission=None,
                        metrics=TierMetrics("m", "gateway", "gw"), tokenizer=None)


def test_prefill_is_sent_only_registered_decode_addresses():
    reg = WorkerRegistry(heartbeat_timeout_s=5.0, clock=lambda: 0.0)
    d = reg.register("d0", Role.DECODE, "127.0.0.1:7001", "m", F32, Load())
    orch = _orchestrator(reg)
    orch._check_destination(d)  # registered: fine

    with pytest.raises(GatewayError) as e:  # an address the registry never held
        orch._check_destination(dataclasses.replace(d, address="10.0.0.9:7001"))
    assert e.value.kind is ErrorKind.UNAVAILABLE
    assert e.value.message.startswith("decode_address: 10.0.0.9:7001")

    reg.deregister("d0")  # left between Reserve and Prefill
    with pytest.raises(GatewayError, match="decode_address: 127.0.0.1:7001"):
        orch._check_destination(d)

    reg.register("d0", Role.PREFILL, "127.0.0.1:7001", "m", F32, Load())  # switched role
    with pytest.raises(GatewayError, match="no longer a registered decode worker"):
        orch._check_destination(d)
