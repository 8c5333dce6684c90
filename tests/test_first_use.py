"""A fresh server does its one-time work at start, not inside a client's first request: an import or
a build there runs under the server's event loop (or holds the GIL beside it) and stalls every stream
and /health. Found twice: jinja2 and the chat template on the first chat request (0.16-0.8 s through
Ray Serve), numpy on the first body deep enough for the depth scan (~0.11 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shepherd.bench.loadgen import start_server, stop_server, wait_healthy

pytestmark = pytest.mark.e2e

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "first_use_probe.py")


def _probe(*args: str) -> dict:
    p = subprocess.run([sys.executable, PROBE, *args], capture_output=True, text=True, timeout=600)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("FIRST-USE ")]
    assert line, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    res = json.loads(line[-1][len("FIRST-USE "):])
    assert "error" not in res, res
    bad = {k: v for k, v in res["statuses"].items() if v >= 500}
    assert not bad, res["statuses"]
    assert res["statuses"]["bad body"] == 400 and res["statuses"]["chat"] == 200, res["statuses"]
    assert not res["imports"], "first requests imported, in the server's process:\n" + "\n".join(
        f"  {k}: {', '.join(v[:12])}{' ...' if len(v) > 12 else ''}" for k, v in res["imports"].items())
    return res


def test_no_first_request_of_any_kind_imports_a_module_in_the_server():
    _probe("serve", "--executor", "sim")


def test_no_first_request_of_any_kind_imports_a_module_in_the_gateway():
    proc, url = start_server(["--executor", "sim"], cwd=os.path.dirname(os.path.dirname(PROBE)))
    try:
        wait_healthy(url, proc)
        _probe("gateway", "--backend", url)
    finally:
        stop_server(proc)
