"""The real gateway process on the default model, a GGUF: it loads the tokenizer and
config from their export (made once by a child process, pdserve.engine.model_files), never
loads torch, and tokenizes exactly as the GGUF's own tokenizer (read from the GGUF through
torch) does: plain text and the chat template's output. The workers load the same export,
through the tokenizer class it names."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from pdserve.engine import model_files
from pdserve.engine.model_files import (
    chat_text,
    gguf_export_dir,
    load_tokenizer,
    read_gguf_tokenizer,
    resolve_model,
)

TEXTS = ["Hello world", "  leading spaces and tabs\t\tend ", "café 😀 naïve — ünïcödé",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2\n", "1234567890"]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]


def _hidden_torch_tokenize(env: dict[str, str]) -> dict:
    """What a torch-free process (the gateway's way of loading) makes of TEXTS and MESSAGES."""
    code = (
        "import json, sys\n"
        "from pdserve.engine import model_files as mf\n"
        "mf.hide_torch()\n"
        "s = mf.resolve_model('smollm2-135m')\n"
        "tok, cfg = mf.load_tokenizer(s), mf.load_config(s)\n"
        f"texts, messages = {TEXTS!r}, {MESSAGES!r}\n"
        "chat = mf.chat_text(tok, messages)\n"
        "assert sys.modules['torch'] is None\n"
        "print(json.dumps({'ids': [tok.encode(t) for t in texts + [chat]], 'chat': chat,\n"
        "                  'eos': mf.eos_token_ids(cfg, tok, s), 'vocab': cfg.vocab_size,\n"
        "                  'ctx': cfg.max_position_embeddings,\n"
        "                  'decoded': tok.decode(tok.encode(texts[2]))}))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _prompt_tokens(url: str, path: str, body: dict) -> int:
    """The prompt's token count as the gateway counted it: a max_tokens of the whole context
    is refused with a message naming it (no worker is needed for that)."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "max_tokens": 8192})
                                 .encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400
    message = json.loads(e.value.read())["error"]["message"]
    m = re.search(r"prompt \((\d+) tokens\)", message)
    assert m, message
    return int(m.group(1))


@pytest.mark.slow
def test_gateway_on_a_gguf_stays_torch_free_and_tokenizes_as_the_workers(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PDSERVE_KERNEL_CACHE": str(tmp_path / "cache")}
    source = resolve_model("smollm2-135m")
    gguf_tok = read_gguf_tokenizer(source)  # the reference: read from the GGUF itself
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.gateway", "--model", "smollm2-135m",
         "--http-port", "0", "--grpc-port", "0", "--registry-port", "0"],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, lines = None, []
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"gateway ready: grpc=\S+ http=(\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url is not None, "the gateway did not start:\n" + "".join(lines[-20:])
        exports = list((tmp_path / "cache" / "tokenizers").iterdir())
        assert [p.name for p in exports] == [gguf_export_dir(
            os.path.join(source.directory, source.gguf_file)).name]  # no temp dir left
        assert {"config.json", "tokenizer.json"} <= {p.name for p in exports[0].iterdir()}

        for text in TEXTS:
            assert _prompt_tokens(url, "/v1/completions", {"prompt": text}) == len(
                gguf_tok.encode(text)), text
        chat = chat_text(gguf_tok, MESSAGES)
        assert _prompt_tokens(url, "/v1/chat/completions", {"messages": MESSAGES}) == len(
            gguf_tok.encode(chat))

        with open(f"/proc/{proc.pid}/maps") as f:
            maps = f.read()
        with open(f"/proc/{proc.pid}/status") as f:
            rss = re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)
        print(f"gateway on smollm2-135m: VmRSS {int(rss) // 1024} MiB")
        assert "libtorch" not in maps, "the gateway process loaded torch"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    # exact ids, from the same export, loaded the gateway's way (torch hidden)
    got = _hidden_torch_tokenize(env)
    assert got["chat"] == chat
    assert got["ids"] == [gguf_tok.encode(t) for t in TEXTS + [chat]]
    assert got["decoded"] == gguf_tok.decode(gguf_tok.encode(TEXTS[2]))
    # a worker's way (torch loaded): the export again, through the class it names
    worker_tok = load_tokenizer(source)
    assert type(worker_tok).__name__ == "TokenizersBackend"
    assert chat_text(worker_tok, MESSAGES) == chat
    assert [worker_tok.encode(t) for t in TEXTS + [chat]] == got["ids"]
    assert worker_tok.decode(got["ids"][2]) == got["decoded"]
    cfg = model_files.load_config(source)
    assert (got["vocab"], got["ctx"]) == (cfg.vocab_size, cfg.max_position_embeddings)
    assert tuple(got["eos"]) == model_files.eos_token_ids(cfg, gguf_tok, source)
