"""The compatibility fingerprint a worker registers with and the gateway compares against
its own: two processes may serve the same request only when every field matches (the KV
layout is compared separately, through `KVCacheSpec`).

- weights: sha256 over config.json and, per weight file (name order), its name, size and
  `SAMPLES` evenly spaced 64 KiB samples of its bytes (a GGUF's first sample is its
  header). Reading ~0.5 MiB per file keeps start-up cheap for any model size; a
  different checkpoint of the same architecture (base vs instruct, a fine-tune) changes
  essentially every tensor and so the samples. It does not detect a few edited bytes.
- tokenizer: sha256 over the tokenizer files in the model directory; a GGUF that carries
  its tokenizer inside is covered by its header, whose first 4 MiB are hashed here too.
- proto version (`PROTO_VERSION`, bumped when a wire change breaks older peers) and the
  pdserve version.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import pdserve
from pdserve.engine.model_files import ModelSource, resolve_model

PROTO_VERSION = 2  # 2: registry on its own service, reservation secrets
SAMPLES = 8
SAMPLE_BYTES = 64 * 1024
GGUF_HEADER_BYTES = 4 * 2**20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt", "merges.txt", "special_tokens_map.json",
                    "added_tokens.json", "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class Fingerprint:
    weights_sha256: str
    tokenizer_sha256: str
    proto_version: int = PROTO_VERSION
    pdserve_version: str = pdserve.__version__

    def differences(self, other: Fingerprint) -> list[str]:
        """Names of the fields that differ (empty: compatible)."""
        return [f for f in ("weights_sha256", "tokenizer_sha256", "proto_version",
                            "pdserve_version") if getattr(self, f) != getattr(other, f)]


def _sample(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        step = max(0, size - SAMPLE_BYTES) // max(1, SAMPLES - 1)
        for i in range(SAMPLES):
            f.seek(min(i * step, max(0, size - SAMPLE_BYTES)))
            h.update(f.read(SAMPLE_BYTES))


def _weight_files(source: ModelSource) -> list[Path]:
    d = Path(source.directory)
    if source.gguf_file:
        return [d / source.gguf_file]
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)


def of_source(source: ModelSource) -> Fingerprint:
    d = Path(source.directory)
    w = hashlib.sha256()
    config = d / "config.json"
    if config.is_file():
        w.update(config.read_bytes())
    for p in _weight_files(source):
        _sample(w, p)
    t = hashlib.sha256()
    for name in _TOKENIZER_NAMES:
        p = d / name
        if p.is_file():
            t.update(f"{name}\0".encode())
            t.update(p.read_bytes())
    if source.gguf_file:
        with open(d / source.gguf_file, "rb") as f:
            t.update(f.read(GGUF_HEADER_BYTES))
    return Fingerprint(w.hexdigest(), t.hexdigest())


def of_model(model: str) -> Fingerprint:
    """The fingerprint of a `--model` value (alias, directory or .gguf path)."""
    return of_source(resolve_model(os.fspath(model)))


def to_proto(fp: Fingerprint):
    from pdserve.protos.pdserve.v1 import gateway_pb2

    return gateway_pb2.Fingerprint(weights_sha256=fp.weights_sha256,
                                   tokenizer_sha256=fp.tokenizer_sha256,
                                   proto_version=fp.proto_version,
                                   pdserve_version=fp.pdserve_version)


def from_proto(msg) -> Fingerprint:
    return Fingerprint(msg.weights_sha256, msg.tokenizer_sha256, msg.proto_version,
                       msg.pdserve_version)
