"""vLLM's POST /tokenize and /detokenize (server/tokenization.py) against a real server on the demo
checkpoint: a prompt's and a chat's ids are the ones the completions take (their usage counts, and
a token prompt from /tokenize answers as its text does), ids come back to their text, and bad
requests get a 4xx naming the problem."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

KEY = {"Authorization": "Bearer sk-local"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server():
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=256,
                      api_keys=("sk-local",))
    with LiveServer(create_app(cfg)) as s:
        yield s.url, openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-local", max_retries=0, timeout=120)


def _post(url: str, path: str, body: dict, headers: dict = KEY) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def test_a_prompts_ids_are_the_ones_a_completion_takes(server):
    url, oai = server
    text = "The quick brown fox jumps over"
    r = _post(url, "/tokenize", {"model": "demo", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["count"] == len(got["tokens"]) > 3 and got["max_model_len"] == 256
    assert len(got["token_strs"]) == got["count"] and all(isinstance(s, str) for s in got["token_strs"])
    kw = dict(model="demo", max_tokens=6, temperature=0)
    by_text = oai.completions.create(prompt=text, **kw)
    assert by_text.usage.prompt_tokens == got["count"]
    by_ids = oai.completions.create(prompt=got["tokens"], **kw)
    assert by_ids.choices[0].text == by_text.choices[0].text
    back = _post(url, "/detokenize", {"model": "demo", "tokens": got["tokens"]}).json()
    assert back["prompt"].endswith(text)         # (after the tokenizer's own prefix, if it adds one)
    plain = _post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()   # model optional
    assert plain["tokens"] == got["tokens"][got["count"] - plain["count"]:]
    assert _post(url, "/detokenize", {"tokens": plain["tokens"]}).json()["prompt"] == text


def test_a_chats_ids_are_the_ones_a_chat_completion_takes(server):
    url, oai = server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Oslo?"}]
    for extra in ({}, {"tools": [TOOL]}):     # (the demo's template has no call syntax: tool_choice none)
        got = _post(url, "/tokenize", {"model": "demo", "messages": messages, **extra}).json()
        chat = oai.chat.completions.create(model="demo", messages=messages, max_tokens=1, **extra,
                                           **({"tool_choice": "none"} if extra else {}))
        assert got["count"] == chat.usage.prompt_tokens, extra
    without = _post(url, "/tokenize", {"messages": messages}).json()["count"]
    no_gen = _post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["count"]
    assert no_gen < without


@pytest.mark.parametrize("path,body,status,word", [
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "exactly one"),
    ("/tokenize", {}, 400, "exactly one"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, 400, "template"),
    ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "does not exist"),
    ("/tokenize", {"prompt": "hi", "colour": 1}, 400, "colour"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "token ids"),
    ("/detokenize", {"tokens": [-1]}, 400, "token ids"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
])
def test_bad_requests_are_refused_naming_the_problem(server, path, body, status, word):
    url, _ = server
    r = _post(url, path, body)
    assert r.status_code == status, r.text
    assert word in r.json()["error"]["message"]


def test_the_api_key_guards_them(server):
    url, _ = server
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert _post(url, path, body, headers={}).status_code == 401
