"""The committed stubs are exactly what protos/generate.py produces, and import as
`pdserve.protos.pdserve.v1` without touching the `pdserve` CLI package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.protos.generate", "--check"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_import_under_protos_package() -> None:
    from pdserve.protos.pdserve.v1 import (
        common_pb2,
        decode_pb2_grpc,
        gateway_pb2_grpc,
        kvtransfer_pb2,
        kvtransfer_pb2_grpc,
        prefill_pb2_grpc,
    )

    assert common_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].methods_by_name["Push"]
    for module, service in [
        (decode_pb2_grpc, "DecodeWorker"), (prefill_pb2_grpc, "PrefillWorker"),
        (gateway_pb2_grpc, "Gateway"), (kvtransfer_pb2_grpc, "KVTransfer"),
    ]:
        assert hasattr(module, f"{service}Stub")
        assert hasattr(module, f"add_{service}Servicer_to_server")


def test_optional_sampling_fields_track_presence() -> None:
    from pdserve.protos.pdserve.v1 import common_pb2

    params = common_pb2.SamplingParams()
    assert not params.HasField("temperature") and not params.HasField("seed")
    params.temperature = 0.0
    assert params.HasField("temperature")
    roundtrip = common_pb2.SamplingParams.FromString(params.SerializeToString())
    assert roundtrip.HasField("temperature") and roundtrip.temperature == 0.0
