"""Hostile and malformed requests: always an OpenAI-shaped 4xx with a string code, never a 500,
and the server keeps serving afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

MODEL = "demo"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name=MODEL))
    with LiveServer(app) as s:
        yield s


def comp(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 2, **kw}


# (id, path, body: dict -> JSON | bytes -> raw, expected status, expected code or None)
CASES = [
    ("bad-json", COMP, b'{"model": "demo", "prompt": ', 400, "invalid_json"),
    ("json-array", COMP, b"[1, 2, 3]", 400, "invalid_json"),
    ("json-string", CHAT, b'"hello"', 400, "invalid_json"),
    ("empty-body", CHAT, b"", 400, "invalid_json"),
    ("invalid-utf8", COMP, b'{"model": "demo", "prompt": "\xff\xfe\xfa"}', 400, "invalid_encoding"),
    ("deep-nesting", COMP, b"[" * 100000 + b"]" * 100000, 400, "invalid_json"),
    ("nan-temperature", COMP, b'{"model": "demo", "prompt": "x", "temperature": NaN}', 400, None),
    ("missing-model", COMP, {"prompt": "x"}, 400, "missing_required_parameter"),
    ("missing-prompt", COMP, {"model": MODEL}, 400, "missing_required_parameter"),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "missing_required_parameter"),
    ("unknown-model", COMP, comp(model="gpt-4"), 404, "model_not_found"),
    ("unknown-model-chat", CHAT, chat(model="nope"), 404, "model_not_found"),
    ("model-wrong-type", COMP, comp(model=5), 400, "invalid_type"),
    ("max-tokens-string", COMP, comp(max_tokens="5"), 400, "invalid_type"),
    ("max-tokens-float", COMP, comp(max_tokens=2.5), 400, "invalid_type"),
    ("max-tokens-bool", COMP, comp(max_tokens=True), 400, "invalid_type"),
    ("max-tokens-zero", COMP, comp(max_tokens=0), 400, "invalid_value"),
    ("max-tokens-negative", COMP, comp(max_tokens=-1), 400, "invalid_value"),
    ("max-tokens-huge", COMP, comp(max_tokens=10**12), 400, "context_length_exceeded"),
    ("max-tokens-beyond-int64", CHAT, chat(max_tokens=10**30), 400, None),
    ("max-completion-tokens-huge", CHAT, chat(max_tokens=None, max_completion_tokens=99999),
     400, "context_length_exceeded"),
    ("temperature-string", COMP, comp(temperature="hot"), 400, "invalid_type"),
    ("temperature-negative", COMP, comp(temperature=-0.5), 400, "invalid_value"),
    ("temperature-huge", CHAT, chat(temperature=1e9), 400, "invalid_value"),
    ("top-p-zero", COMP, comp(top_p=0), 400, "invalid_value"),
    ("top-p-above-one", COMP, comp(top_p=1.5), 400, "invalid_value"),
    ("top-k-negative", COMP, comp(top_k=-5), 400, "invalid_value"),
    ("n-zero", COMP, comp(n=0), 400, "invalid_value"),
    ("n-huge", CHAT, chat(n=10000), 400, "invalid_value"),
    ("stream-string", COMP, comp(stream="yes"), 400, "invalid_type"),
    ("stream-options-wrong", COMP, comp(stream=True, stream_options={"include_usage": "y"}), 400, None),
    ("seed-string", COMP, comp(seed="abc"), 400, "invalid_type"),
    ("seed-huge", COMP, comp(seed=2**80), 400, "invalid_value"),
    ("stop-number", COMP, comp(stop=5), 400, None),
    ("stop-empty-string", COMP, comp(stop=[""]), 400, "invalid_value"),
    ("stop-too-many", COMP, comp(stop=[str(i) for i in range(50)]), 400, "invalid_value"),
    ("stop-token-out-of-vocab", COMP, comp(stop_token_ids=[10**9]), 400, "invalid_value"),
    ("logprobs-too-many", COMP, comp(logprobs=1000), 400, "invalid_value"),
    ("logprobs-negative", COMP, comp(logprobs=-1), 400, "invalid_value"),
    ("chat-top-logprobs-huge", CHAT, chat(logprobs=True, top_logprobs=100), 400, "invalid_value"),
    ("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "invalid_value"),
    ("chat-logprobs-int", CHAT, chat(logprobs=5), 400, "invalid_type"),
    ("empty-messages", CHAT, chat(messages=[]), 400, None),
    ("messages-not-list", CHAT, chat(messages="hi"), 400, "invalid_type"),
    ("message-bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, None),
    ("message-missing-role", CHAT, chat(messages=[{"content": "x"}]), 400, "missing_required_parameter"),
    ("message-content-number", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400, None),
    ("message-image-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, None),
    ("empty-prompt-list", COMP, comp(prompt=[]), 400, "invalid_value"),
    ("prompt-mixed-list", COMP, comp(prompt=["a", 1]), 400, None),
    ("prompt-token-out-of-vocab", COMP, comp(prompt=[1, 2, 999999]), 400, "invalid_value"),
    ("prompt-token-negative", COMP, comp(prompt=[-3]), 400, "invalid_value"),
    ("prompt-empty-token-list", COMP, comp(prompt=[[]]), 400, "invalid_value"),
    ("prompt-null", COMP, comp(prompt=None), 400, None),
    ("oversize-token-prompt", COMP, comp(prompt=[5] * 5000), 400, "context_length_exceeded"),
    ("oversize-text-prompt", COMP, comp(prompt="word " * 20000), 400, "context_length_exceeded"),
    ("oversize-chat", CHAT, chat(messages=[{"role": "user", "content": "word " * 20000}]),
     400, "context_length_exceeded"),
    ("too-many-prompts", COMP, comp(prompt=["a"] * 1025), 400, "invalid_value"),
    ("too-many-sequences", COMP, comp(prompt=["a"] * 64, n=16), 400, "too_many_sequences"),
    ("presence-penalty-range", COMP, comp(presence_penalty=2.5), 400, None),
    ("frequency-penalty-range", CHAT, chat(frequency_penalty=-3.0), 400, None),
    ("repetition-penalty-zero", COMP, comp(repetition_penalty=0.0), 400, None),
    ("min-p-range", COMP, comp(min_p=1.5), 400, None),
    ("logit-bias-key", COMP, comp(logit_bias={"abc": 10}), 400, None),
    # str.isdigit() takes "²" (int() then raised: a 500) and "٥" (read as 5)
    ("logit-bias-key-superscript", COMP, comp(logit_bias={"\u00b2": 10}), 400, "invalid_value"),
    ("logit-bias-key-non-ascii-digit", CHAT, chat(logit_bias={"\u0665": 10}), 400, "invalid_value"),
    ("logit-bias-token", COMP, comp(logit_bias={"99999999": 10}), 400, None),
    ("logit-bias-value", COMP, comp(logit_bias={"5": 101}), 400, None),
    ("min-tokens-over-max", COMP, comp(min_tokens=50, max_tokens=5), 400, None),
    ("max-tokens-0-without-echo", COMP, comp(max_tokens=0), 400, None),
    ("suffix", COMP, comp(suffix="x"), 400, "unsupported_parameter"),
    ("best-of", COMP, comp(best_of=3), 400, "unsupported_parameter"),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "unsupported_parameter"),
    ("grammar-format", CHAT, chat(response_format={"type": "grammar"}), 400, "unsupported_parameter"),
    ("json-schema-not-object", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": []}}), 400, None),
    ("json-schema-bad-type", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": 7}}}), 400, None),
    ("template-kwargs-wrong", CHAT, chat(chat_template_kwargs=[1]), 400, "invalid_type"),
]


@pytest.mark.parametrize("path,body,status,code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_request_gets_openai_shaped_4xx(server, path, body, status, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in r.text and "File \"" not in r.text
    assert isinstance(err["code"], str)
    if code is not None:
        assert err["code"] == code, err
    assert err["type"] == "invalid_request_error"


def test_oversize_body_is_413(server):
    r = httpx.post(server.url + COMP, content=b" " * (17 * 1024 * 1024),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/nothing", 404), ("GET", COMP, 405), ("DELETE", "/v1/models", 405), ("GET", "/", 404),
])
def test_unknown_routes_and_methods(server, method, path, status):
    r = httpx.request(method, server.url + path)
    assert r.status_code == status
    assert isinstance(r.json()["error"]["code"], str)


def test_unknown_model_card_is_404(server):
    r = httpx.get(server.url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_server_survives_the_whole_suite(server):
    r = httpx.post(server.url + COMP, json=comp(max_tokens=3), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    stats = httpx.get(server.url + "/v1/engine/stats").json()
    assert stats["state"] == "ready" and stats["running"] == 0 and stats["cache_tokens_used"] == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert 'status="500"' not in metrics


def test_random_bodies_never_500(server):
    """A small fuzz: every field gets values of every JSON type; nothing may crash the server."""
    import random

    rng = random.Random(1234)
    values = [None, True, False, 0, 1, -1, 2.5, -1e308, 10**20, "", "x", "\x00\udfff"[:1], [], [1], ["a"],
              [[1, 2]], {}, {"a": 1}, [{"role": "user", "content": "hi"}], "demo"]
    fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
              "stream_options", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs", "echo",
              "ignore_eos", "chat_template_kwargs", "max_completion_tokens", "logit_bias", "user"]
    statuses = set()
    for i in range(150):
        path = COMP if i % 2 else CHAT
        # unknown fields are a 400 (issue 16): each endpoint's base body has only its own fields
        body = comp() if path == COMP else chat()
        for f in rng.sample(fields, rng.randint(1, 4)):
            body[f] = rng.choice(values)
        r = httpx.post(server.url + path, json=body, timeout=30)
        statuses.add(r.status_code)
        assert r.status_code < 500, (body, r.text)
        if r.status_code == 200 and body.get("stream") is True:
            assert r.text.rstrip().endswith("data: [DONE]")
        elif r.status_code != 200:
            assert isinstance(r.json()["error"]["code"], str)
    assert {200, 400} <= statuses
    assert httpx.get(server.url + "/health").status_code == 200
