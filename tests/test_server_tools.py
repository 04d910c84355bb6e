"""Forced tool calls (chat's tools with tool_choice "required" or a named function, server/tools.py)
through a real server and the official openai client on the demo checkpoint: the call comes back
as message.tool_calls with arguments that follow the tool's parameters, streamed as one delta;
what cannot be served is a 400 naming the parameter; tools and past calls reach the template."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from exl3tools.server.protocol import ChatCompletionRequest, message_dicts  # noqa: E402
from exl3tools.server.template import ChatTemplate  # noqa: E402
from exl3tools.server.tools import template_tools  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the forecast",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}}}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(demo_openai):
    return demo_openai


def call(client, **kw):
    return client.chat.completions.create(model="demo", messages=kw.pop("messages", MESSAGES), tools=kw.pop("tools", TOOLS),
                                          max_tokens=kw.pop("max_tokens", 60), **kw)


def _valid(name, arguments) -> bool:
    args = json.loads(arguments)
    if name == "now":
        return args == {}
    return (name == "get_weather" and set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome")
            and isinstance(args["days"], int) and 1 <= args["days"] <= 3)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_required_gives_one_valid_call(client, temperature):
    r = call(client, tool_choice="required", temperature=temperature, seed=2, n=2)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (tc,) = c.message.tool_calls
        assert tc.type == "function" and tc.id.startswith("call_") and _valid(tc.function.name, tc.function.arguments)


@pytest.mark.parametrize("tool", [WEATHER, NOW])
def test_a_named_function_is_the_one_called(client, tool):
    name = tool["function"]["name"]
    c = call(client, tool_choice={"type": "function", "function": {"name": name}}, temperature=0.9, seed=4).choices[0]
    (tc,) = c.message.tool_calls
    assert tc.function.name == name and _valid(name, tc.function.arguments)


def test_a_streamed_call_arrives_as_one_tool_calls_delta(client):
    chunks = [ch for ch in call(client, tool_choice="required", temperature=0, stream=True) if ch.choices]
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant" and not any(d.content for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and _valid(calls[0].function.name, calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = call(client, tool_choice="required", temperature=0).choices[0].message.tool_calls[0]
    assert (whole.function.name, whole.function.arguments) == (calls[0].function.name, calls[0].function.arguments)


def test_a_call_cut_by_max_tokens_comes_back_as_text(client):
    c = call(client, tool_choice="required", temperature=0, max_tokens=3).choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls and c.message.content.startswith("{")


def test_a_call_and_its_result_in_the_history_are_accepted(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = call(client, messages=history, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens == 4


@pytest.mark.parametrize("kw,param,code", [
    ({}, "tool_choice", "unsupported_parameter"),                               # "auto" by default
    ({"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "invalid_value"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "invalid_value"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "invalid_value"),
    ({"tool_choice": "required", "tools": [WEATHER, WEATHER]}, "tools", "invalid_value"),
    ({"tool_choice": "required", "tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type",
     "unsupported_parameter"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "invalid_value"),
    ({"tool_choice": "required", "extra_body": {"ignore_eos": True}}, "tool_choice", "invalid_value"),
])
def test_what_cannot_be_served_is_a_400(client, kw, param, code):
    if kw.get("tools", "given") is None:
        kw.pop("tools")
        kw["tools"] = openai.NOT_GIVEN
    with pytest.raises(openai.BadRequestError) as e:
        call(client, max_tokens=4, **kw)
    assert (e.value.body["param"], e.value.body["code"]) == (param, code), e.value.body


def test_tools_and_past_calls_reach_the_template():
    """The template gets the tools in OpenAI's shape and an assistant's calls with their arguments
    as mappings (templates iterate over them), the tool's answer with its call id."""
    req = ChatCompletionRequest.model_validate({"model": "m", "tools": TOOLS, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]})
    src = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{% for c in m.tool_calls or [] %}"
           "{{ c.function.name }}({% for k, v in c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}){% endfor %}"
           "{% if m.tool_call_id %}<{{ m.tool_call_id }}:{{ m.content }}>{% endif %}{% endfor %}")
    out = ChatTemplate(src).render(message_dicts(req), add_generation_prompt=False, tools=template_tools(req))
    assert out == "[get_weather][now]get_weather(city=Rome;days=2;)<c1:rain>"
