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


@pytest.mark.slow
def test_a_worker_writes_the_missing_export_and_reads_the_gguf_where_it_cannot(
        tmp_path, monkeypatch, caplog):
    """A process with torch (a worker) whose export is missing writes it itself and loads
    the tokenizer from it; where the cache cannot be written it reads the GGUF, as before."""
    from pdserve.engine.model_files import load_tokenizer, resolve_model

    source = resolve_model("smollm2-135m")
    texts = ["Hello world", "café 😀", "<|im_start|>user\nhi<|im_end|>"]
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "file" / "cache"))
    with caplog.at_level("WARNING", logger="pdserve.engine"):
        direct = load_tokenizer(source)
    assert "could not export the tokenizer and config" in caplog.text
    assert direct.name_or_path == source.directory  # read from the GGUF
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    written = load_tokenizer(source)
    exports = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert [p.name for p in exports] == [gguf_export_dir(
        f"{source.directory}/{source.gguf_file}").name]
    assert type(written).__name__ == "TokenizersBackend"
    assert written.name_or_path == str(exports[0])
    assert [written.encode(t) for t in texts] == [direct.encode(t) for t in texts]
