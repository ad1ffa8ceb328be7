"""The GGUF export's cache key (pdserve.engine.model_files): the header walk against the
gguf library's own writer and reader, and the key following the metadata, not the
weights. The export itself, through the real gateway, is in test_gateway_gguf.py."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.model_files import gguf_export_dir, gguf_header_size


def _write_gguf(path, *, name: str = "tiny", weight: float = 1.0) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_uint32("llama.context_length", 64)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "bb", "ccc"])
    w.add_array("tokenizer.ggml.scores", [0.0, 0.0, -1.0, -2.0, -3.0])
    w.add_array("nested", [[1, 2], [3]])  # an array of arrays: walked element by element
    w.add_tensor("a.weight", np.full((3, 5), weight, dtype=np.float32))
    w.add_tensor("b.weight", np.zeros(7, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_header_walk_ends_where_the_tensor_data_begins(tmp_path):
    from gguf import GGUFReader

    path = tmp_path / "m.gguf"
    _write_gguf(path)
    reader = GGUFReader(str(path))
    size = gguf_header_size(path)
    # the data starts at the header's end rounded up to the alignment (32 by default)
    assert reader.data_offset - 32 < size <= reader.data_offset
    assert reader.data_offset == (size + 31) // 32 * 32
    with pytest.raises(ValueError, match="not a GGUF"):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGML" + bytes(60))
        gguf_header_size(bad)


def test_export_key_follows_the_metadata_not_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    paths = {}
    for label, kw in {"base": {}, "weights": {"weight": 2.0}, "meta": {"name": "other"}}.items():
        paths[label] = tmp_path / f"{label}.gguf"
        _write_gguf(paths[label], **kw)
    base = gguf_export_dir(paths["base"])
    assert base.parent == tmp_path / "cache" / "tokenizers"
    assert gguf_export_dir(paths["weights"]) == base
    assert gguf_export_dir(paths["meta"]) != base


def test_a_worker_reads_the_export_where_it_exists_and_the_gguf_where_not(
        tmp_path, monkeypatch):
    """A process with torch (a worker) takes the tokenizer from the export when one exists
    (the gateway's first start or the Makefile's setup made it), and reads the GGUF when
    none does (that read is test_gateway_gguf's reference)."""
    from pdserve.engine import model_files
    from pdserve.engine.model_files import load_tokenizer, resolve_model

    source = resolve_model("smollm2-135m")
    export = gguf_export_dir(f"{source.directory}/{source.gguf_file}")
    if not export.is_dir():
        pytest.skip("no export of the default model here (the Makefile's setup makes it)")
    assert model_files._hf_location(source) == (str(export), {})
    tok = load_tokenizer(source)
    assert type(tok).__name__ == "TokenizersBackend" and tok.name_or_path == str(export)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    assert model_files._hf_location(source) == (
        source.directory, {"gguf_file": source.gguf_file})
    assert not (tmp_path / "cache").exists()  # nothing written by a process with torch
