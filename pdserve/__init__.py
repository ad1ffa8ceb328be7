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

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")) and _os.path.isfile(
        _os.path.join(_ROOT, "protos", "pdserve", "v1", "common.proto")):
    __path__.append(_ROOT)  # noqa: F821 - a package's own __path__
