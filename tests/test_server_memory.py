"""Servers and runners made one after another in one process are freed once they end: LiveServer's
exit clears FastAPI's caches of endpoint functions (which kept every app's engine and model alive),
and a closed tensor-parallel runner drops load_runner's exit hook (which kept it until exit)."""

from __future__ import annotations

import gc
import weakref

import httpx
import pytest

pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402


def test_an_ended_live_server_frees_its_engine_and_model():
    refs = []
    for _ in range(2):
        app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_context=64))
        with LiveServer(app) as s:
            r = httpx.post(f"{s.url}/v1/completions", json={"model": "demo", "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            engine = app.state.server.engine
            refs += [weakref.ref(engine), weakref.ref(engine.runner)]
        del app, s, engine, r
    gc.collect()
    assert [ref() for ref in refs] == [None] * 4, "an ended server's engine or runner is still alive"


def test_a_closed_tensor_parallel_runner_is_freed():
    """load_runner registers a TP runner's close at exit (the workers must be stopped); once closed
    the hook is dropped, so the runner and its model do not live until the process ends."""
    from exl3tools.runtime.runner import load_runner

    r = load_runner(DEMO / "model", tp=2, moe="ep", max_cache_tokens=64)
    ref = weakref.ref(r)
    r.close()
    del r
    gc.collect()
    assert ref() is None, "a closed TP runner is still alive"
