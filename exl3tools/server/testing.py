"""A real uvicorn server on 127.0.0.1 in a background thread, for tests and benchmarks."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import uvicorn


class LiveServer:
    """``with LiveServer(app) as s: s.url`` -- binds a free port first, so there is no race."""

    def __init__(self, app: Any, *, ready_timeout: float = 120.0, wait_ready: bool = True) -> None:
        self.app, self.ready_timeout, self.wait_ready = app, ready_timeout, wait_ready
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn", daemon=True)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        if self.wait_ready:
            self.until_ready(deadline)
        return self

    def until_ready(self, deadline: float | None = None) -> None:
        deadline = deadline or time.monotonic() + self.ready_timeout
        while True:
            r = httpx.get(f"{self.url}/health", timeout=5)
            if r.status_code == 200:
                return
            if r.json().get("status") == "failed" or time.monotonic() > deadline:
                raise RuntimeError(f"server not ready: {r.text}")
            time.sleep(0.05)

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self._thread.join(15)
        self._sock.close()
        forget_endpoints()


def forget_endpoints() -> None:
    """Clear FastAPI's module-level caches of endpoint functions. FastAPI (0.16x,
    fastapi/dependencies/models.py) classifies each endpoint in lru_caches of 4096 entries that hold
    the function itself, and create_app's endpoints close over its Server: every app made in one
    process kept its engine and model alive (tests/test_serve_speculative.py held 11 GB in one test
    worker, and make test's workers were OOM-killed on a 23 GB machine). One app a process (serve)
    never notices."""
    import sys

    models = sys.modules.get("fastapi.dependencies.models")
    for name in dir(models) if models is not None else ():
        clear = getattr(getattr(models, name), "cache_clear", None)
        if callable(clear):
            clear()
