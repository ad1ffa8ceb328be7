"""pdserve: disaggregated prefill/decode LLM serving — the one import namespace.

Everything imports as `pdserve.*`: the engine (`pdserve.engine`), the benchmark harness
(`pdserve.bench`), the command line and the workers' shared runtime live in this folder;
the design card's top-level folders (`protos/`, `gateway/`, `prefill_worker/`,
`decode_worker/`, `kvtransfer/`) stay at the repository root and import as
`pdserve.protos`, `pdserve.gateway`, ... An installed wheel puts them inside this package
(pyproject's package-dir); a source checkout that is not installed (the GPU machine runs
`scripts/gpu_check.sh` from one) finds them through the repository root below.
"""

import os as _os

__version__ = "0.1.0"

# gRPC's I/O on its iomgr poller rather than on EventEngine (grpcio's default). On
# EventEngine every message a grpc.aio call reads or writes passes from gRPC's own threads
# to the poller thread of grpc.aio and then to the event loop. With one stream through
# `pdserve up`, iomgr took 12-24 % less of the gateway's CPU a token and 6-17 % less of
# the decode worker's outside its engine (docs/benchmarks.md, section 6, session 25). Set
# before anything imports grpc; a GRPC_EXPERIMENTS already set is left as it is.
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
_os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")) and _os.path.isfile(
        _os.path.join(_ROOT, "protos", "pdserve", "v1", "common.proto")):
    __path__.append(_ROOT)  # noqa: F821 - a package's own __path__
