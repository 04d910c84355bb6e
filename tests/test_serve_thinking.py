"""Thinking on or off per request, through the chat template's switch (server/reasoning.py):
chat's ``reasoning_effort``, the Responses API's ``reasoning.effort`` and the Messages API's
``thinking`` each render the prompt that ``chat_template_kwargs`` with ``enable_thinking`` /
``thinking`` renders (counted by /tokenize on a real server, a template that prints what it got),
an explicit ``chat_template_kwargs`` wins, and bad values are 400s naming the field."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}no think no think no think {% endif %}"
            "{% if thinking is defined and thinking %}think {% endif %}"
            "{% if reasoning_effort is defined %}effort {{ reasoning_effort }} {% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}")
MSGS = [{"role": "user", "content": "Say hi"}]


@pytest.fixture
def server(scripted):
    client = scripted(TEMPLATE, "hi")
    return str(client.base_url).rstrip("/").removesuffix("/v1"), client


def _count(url: str, **kwargs) -> int:
    r = httpx.post(f"{url}/tokenize", json={"messages": MSGS, "chat_template_kwargs": kwargs}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_each_api_switches_thinking_through_the_template(server):
    url, client = server
    default, off, on = _count(url), _count(url, enable_thinking=False, thinking=False), \
        _count(url, enable_thinking=True, thinking=True)
    assert len({default, off, on}) == 3

    def chat(**kw) -> int:
        return client.chat.completions.create(model="demo", messages=MSGS, max_tokens=1, **kw).usage.prompt_tokens

    assert chat() == default
    for effort, think in (("none", False), ("minimal", False), ("low", True), ("high", True)):
        assert chat(reasoning_effort=effort) == _count(url, enable_thinking=think, thinking=think,
                                                       reasoning_effort=effort), effort
    # the request's own template kwargs win over reasoning_effort's switch
    assert chat(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True,
                                                                              "thinking": True}}) == \
        _count(url, enable_thinking=True, thinking=True, reasoning_effort="none")

    def responses(**kw) -> int:
        r = httpx.post(f"{url}/v1/responses", json={"model": "demo", "input": MSGS, "max_output_tokens": 1, **kw},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]

    assert responses() == default
    assert responses(reasoning={"effort": "none"}) == _count(url, enable_thinking=False, thinking=False,
                                                             reasoning_effort="none")
    assert responses(reasoning={"effort": "high", "summary": "auto"}) == \
        _count(url, enable_thinking=True, thinking=True, reasoning_effort="high")

    def messages(path: str = "/v1/messages", **kw) -> int:
        body = {"model": "demo", "messages": MSGS, **kw, **({"max_tokens": 1} if path == "/v1/messages" else {})}
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"] if path == "/v1/messages" else r.json()["input_tokens"]

    assert messages() == default
    assert messages(thinking={"type": "disabled"}) == off
    assert messages(thinking={"type": "enabled", "budget_tokens": 1024}) == on
    assert messages("/v1/messages/count_tokens", thinking={"type": "disabled"}) == off


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": MSGS, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("/v1/messages", {"messages": MSGS, "max_tokens": 1, "thinking": {"type": "on"}}, "thinking.type"),
])
def test_bad_switches_are_refused_naming_the_field(server, path, body, param):
    url, _ = server
    r = httpx.post(f"{url}{path}", json={"model": "demo", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.get("param", param) == param and param.split(".")[0] in err["message"]
