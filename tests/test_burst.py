"""`pdserve up` on a two-core machine: the layout it picks by default (colocated, said at
start-up) and the disaggregated one both serve a burst of 64 requests sent at once without
losing one — every request answers 200."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

BURST = 64


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=240) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _up(model: str, *argv: str) -> tuple[subprocess.Popen, str, str]:
    """`pdserve up` on two cores; (process, its stdout banner, the HTTP url)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", model, "--http-port", "0",
         "--grpc-port", "0", "--kv-cache-memory", "64MiB", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cores))  # noqa: PLW1509
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            break
    banner = "".join(lines)
    m = re.search(r"OpenAI HTTP\s+(http://\S+)/v1", banner)
    if m is None:
        proc.kill()
        raise AssertionError(banner + proc.stderr.read())
    return proc, banner, m.group(1)


@pytest.mark.parametrize("argv,layout", [((), "colocated"),
                                         # and tokens four to a message (the flag reaches
                                         # the decode worker through `pdserve up`)
                                         (("--prefill", "1", "--stream-interval", "4"),
                                          "disaggregated")])
def test_a_burst_of_64_loses_nothing(tiny_model_dir, argv, layout):
    proc, banner, url = _up(tiny_model_dir, *argv)
    try:
        assert f"layout       {layout}" in banner
        if not argv:
            assert "core(s) < 4" in banner  # the reason, on this two-core layout
        bodies = [{"model": tiny_model_dir, "prompt": f"Request {i}: once upon a time",
                   "max_tokens": 8 + i % 9, "temperature": 0, "ignore_eos": True}
                  for i in range(BURST)]
        with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
            codes = list(pool.map(lambda b: _post(url, b), bodies))
        assert codes == [200] * BURST
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
