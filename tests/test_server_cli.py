"""`exl3tools serve` as users run it: a subprocess, the demo model by default, signals, bad paths."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from tests.conftest import REPO  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "exl3tools.cli", "serve", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serves_the_demo_without_a_path_and_stops_cleanly_on_sigterm():
    port = free_port()
    proc = serve("--port", str(port), "--log-level", "warning")
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        assert name == "glm4_moe-3.0bpw-mcg"
        r = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught (the conventional status)
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert "Traceback" not in err


@pytest.mark.parametrize("args,code,text", [
    (["/nonexistent/model"], 2, "no such checkpoint directory"),
    ([str(REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model"), "--tp", "3"], 3, "cannot slice"),
    (["--max-batch", "0"], 2, "must be at least 1"),
])
def test_bad_invocations_fail_in_one_line(args, code, text):
    proc = serve(*args, "--port", str(free_port()), "--log-level", "critical")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert text in err and "Traceback" not in err
