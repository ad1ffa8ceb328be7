"""`pdserve generate`: the completion alone on stdout, logs on stderr, clear errors."""

from __future__ import annotations

import subprocess
import sys

from conftest import tiny_engine

from pdserve.protocol import SamplingParams


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_prints_only_the_completion(tiny_model_dir):
    r = _run("--model", tiny_model_dir, "--prompt", "The river city", "--max-tokens", "6",
             "--kv-cache-memory", "16MiB")
    assert r.returncode == 0, r.stderr
    eng = tiny_engine(tiny_model_dir)
    expected = eng.generate(["The river city"], SamplingParams(max_tokens=6, temperature=0))
    assert r.stdout == expected[0].text + "\n"
    assert "finish_reason" in r.stderr and "finish_reason" not in r.stdout


def test_generate_rejects_bad_parameters(tiny_model_dir):
    r = _run("--model", tiny_model_dir, "--prompt", "x", "--temperature", "-1")
    assert r.returncode == 2
    assert "temperature" in r.stderr and r.stdout == ""


def test_generate_help_lists_its_flags():
    r = _run("--help")
    assert r.returncode == 0
    for flag in ("--prompt", "--chat", "--max-tokens", "--temperature", "--model"):
        assert flag in r.stdout
