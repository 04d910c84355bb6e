"""Request-protocol gaps, against a real server on the demo checkpoint: JSON null on an optional
field means its default (as OpenAI's nullable fields and vLLM read it), a chat content part other
than text is a 400 unsupported_parameter naming its type, and the developer role renders as system
unless the chat template knows it."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url():
    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_context=256))
    with LiveServer(app) as s:
        yield s.url


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _error(r: httpx.Response, code: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


# ------------------------------------------------------------------ null means the default

NULLS = {"n": None, "stream": None, "stream_options": {"include_usage": None}, "ignore_eos": None,
         "return_token_ids": None, "temperature": None, "seed": None, "stop": None, "user": None}


def test_chat_nulls_are_the_defaults(url):
    body = {"model": "demo", "messages": MSGS, "max_tokens": 3, "temperature": 0}
    want = _post(url, "/v1/chat/completions", body).json()
    r = _post(url, "/v1/chat/completions", {**body, **NULLS, "temperature": 0, "logprobs": None,
                                            "top_logprobs": None, "add_generation_prompt": None,
                                            "max_completion_tokens": None, "response_format": None})
    assert r.status_code == 200, r.text
    got = r.json()                                    # not streamed, one choice, no logprobs / ids
    assert r.headers["content-type"].startswith("application/json") and len(got["choices"]) == 1
    c = got["choices"][0]
    assert c["logprobs"] is None and "token_ids" not in c
    assert c["message"]["content"] == want["choices"][0]["message"]["content"]   # generation prompt on


def test_completion_nulls_are_the_defaults(url):
    body = {"model": "demo", "prompt": "The sky is", "max_tokens": 3, "temperature": 0}
    want = _post(url, "/v1/completions", body).json()
    r = _post(url, "/v1/completions", {**body, **NULLS, "temperature": 0, "echo": None, "logprobs": None,
                                       "best_of": None, "suffix": None, "max_tokens": 3})
    assert r.status_code == 200, r.text
    c = r.json()["choices"]
    assert len(c) == 1 and c[0]["text"] == want["choices"][0]["text"]     # no echo
    assert c[0]["logprobs"] is None and "token_ids" not in c[0]


def test_null_stream_options_include_usage_streams_without_usage(url):
    body = {"model": "demo", "prompt": "The sky is", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": None}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(not ch.get("usage") for ch in chunks)


def test_the_openai_client_may_send_none(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="demo", messages=MSGS, max_tokens=2, n=None, logprobs=None,
                                       stream=None, temperature=None)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    r = client.completions.create(model="demo", prompt="hi", max_tokens=2, n=None, echo=None, stream=None)
    assert len(r.choices) == 1


def test_other_apis_take_null_as_the_default(url):
    r = _post(url, "/v1/responses", {"model": "demo", "input": "hi", "max_output_tokens": 2, "stream": None})
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    r = _post(url, "/v1/messages", {"model": "demo", "messages": MSGS, "max_tokens": 2, "stream": None})
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    r = _post(url, "/tokenize", {"messages": MSGS, "add_generation_prompt": None, "return_token_strs": None})
    assert r.status_code == 200 and r.json()["token_strs"] is None, r.text
    assert r.json()["tokens"] == _post(url, "/tokenize", {"messages": MSGS}).json()["tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"model": None, "messages": MSGS}, "model"),
    ("/v1/chat/completions", {"model": "demo", "messages": None}, "messages"),
    ("/v1/completions", {"model": "demo", "prompt": None}, "prompt"),
])
def test_a_required_fields_null_is_still_a_400(url, path, body, param):
    assert _error(_post(url, path, body), "invalid_type")["param"] == param
    r = _post(url, "/v1/messages", {"model": "demo", "messages": MSGS, "max_tokens": None})   # Anthropic's shape
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens:"), r.text


def test_an_unknown_fields_null_is_still_unknown(url):
    assert _error(_post(url, "/v1/completions", {"model": "demo", "prompt": "x", "max_token": None}),
                  "unknown_parameter")["param"] == "max_token"


# ------------------------------------------------------------------ content parts


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_a_non_text_content_part_is_unsupported(url, part):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    err = _error(_post(url, "/v1/chat/completions", {"model": "demo", "messages": messages, "max_tokens": 2}),
                 "unsupported_parameter")
    assert err["param"] == "messages.1.content" and repr(part["type"]) in err["message"], err


def test_text_parts_still_work(url):
    parts = {"model": "demo", "max_tokens": 3, "temperature": 0,
             "messages": [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]}
    r = _post(url, "/v1/chat/completions", parts)
    assert r.status_code == 200, r.text
    plain = _post(url, "/v1/chat/completions", {**parts, "messages": [{"role": "user", "content": "hello"}]}).json()
    assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    _error(_post(url, "/v1/chat/completions", {**parts, "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
           "invalid_type")                                         # a text part without its text


# ------------------------------------------------------------------ the developer role


def test_developer_renders_as_system(url):
    def ids(role):
        r = _post(url, "/tokenize", {"messages": [{"role": role, "content": "be brief"}, *MSGS]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    system = ids("system")
    assert ids("developer") == system
    text = _post(url, "/detokenize", {"tokens": system}).json()["prompt"]
    assert "<|system|>" in text and "developer" not in text      # the demo's template prints any role


def test_a_template_that_knows_developer_gets_it(scripted):
    template = ("{% for m in messages %}{% if m.role == 'developer' %}[developer]{% endif %}"
                "<|{{ m.role }}|>{{ m.content }}{% endfor %}")
    client = scripted(template, "ok")
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    r = _post(root, "/tokenize", {"messages": [{"role": "developer", "content": "be brief"}, *MSGS]})
    assert r.status_code == 200, r.text
    assert "[developer]<|developer|>be brief" in _post(root, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
