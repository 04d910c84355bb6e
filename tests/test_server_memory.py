"""Servers made one after another in one process are freed once they end (LiveServer's exit clears
FastAPI's caches of endpoint functions, which kept every app's engine and model alive)."""

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
