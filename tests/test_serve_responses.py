"""OpenAI's Responses API (POST /v1/responses, server/openai_responses.py) through the official
openai client against a real server on the demo checkpoint: each answer equals the chat
completion its request amounts to (greedy), streamed events arrive in order and add up to the
whole response, forced function calls and their outputs round-trip, text.format holds the answer
to a schema, and what the server cannot do is a 400 naming the field."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                         "required": ["city"], "additionalProperties": False}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


@pytest.fixture(scope="module")
def client():
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=256)
    with LiveServer(create_app(cfg)) as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _events(stream) -> list:
    evs = list(stream)
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[0].type == "response.created" and evs[1].type == "response.in_progress"
    assert evs[-1].type in ("response.completed", "response.incomplete")
    return evs


def test_a_response_is_the_chat_completion_it_amounts_to(client):
    kw = dict(model="demo", max_output_tokens=8, temperature=0)
    r = client.responses.create(input="Say hi", instructions="be brief", **kw)
    chat = client.chat.completions.create(model="demo", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hi"}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content and [o.type for o in r.output] == ["message"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"   # cut at 8
    # message items with text parts, as a conversation's earlier turns come back
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hi"}]}]
    assert client.responses.create(input=items, instructions="be brief", **kw).output_text == r.output_text
    evs = _events(client.responses.create(input="Say hi", instructions="be brief", stream=True, **kw))
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    assert text == r.output_text == evs[-1].response.output_text
    done = [e for e in evs if e.type == "response.output_item.done"]
    assert len(done) == 1 and done[0].item.content[0].text == text


def test_forced_function_calls_round_trip(client):
    kw = dict(model="demo", tools=TOOLS, max_output_tokens=60, temperature=0)
    r = client.responses.create(input="weather?", tool_choice={"type": "function", "name": "get_weather"}, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"} and calls[0].call_id
    evs = _events(client.responses.create(input="weather?", tool_choice="required", stream=True, **kw))
    args = [e.arguments for e in evs if e.type == "response.function_call_arguments.done"]
    assert args == [calls[0].arguments] == [evs[-1].response.output[0].arguments]
    # the call and its output fed back: the same answer as chat's assistant tool_calls + tool message
    c = calls[0]
    back = client.responses.create(model="demo", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments},
        {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}])
    chat = client.chat.completions.create(model="demo", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}]},
        {"role": "tool", "tool_call_id": c.call_id, "content": "sunny"}])
    assert back.output_text == chat.choices[0].message.content


def test_text_format_holds_the_answer_to_a_schema(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    r = client.responses.create(model="demo", input="json please", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert r.status == "completed" and 0 <= json.loads(r.output_text)["a"] <= 9


CHOICES = ["red", "green", "blue", "a.b*c"]
TRIPLE = r"[0-9]{3}-[a-z]{2}"
DIGIT = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
         "additionalProperties": False}


def _digit(text: str) -> bool:
    return 0 <= json.loads(text)["a"] <= 9


@pytest.mark.parametrize("extra,chat_extra,ok", [
    ({"guided_choice": CHOICES}, None, CHOICES.__contains__),
    ({"structured_outputs": {"choice": CHOICES}}, None, CHOICES.__contains__),
    ({"guided_regex": TRIPLE}, None, lambda t: re.fullmatch(TRIPLE, t)),
    ({"structured_outputs": {"regex": TRIPLE}}, None, lambda t: re.fullmatch(TRIPLE, t)),
    ({"guided_json": DIGIT}, None, _digit),
    ({"text": {"format": {"type": "json_schema", "name": "d", "schema": DIGIT}}},
     {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": DIGIT}}}, _digit),
])
def test_vllm_constraints_hold_the_answer(client, extra, chat_extra, ok):
    """vLLM's structured_outputs / guided_* (and text.format) hold the Response's text, sampled,
    whole and streamed; greedy, it is the chat completion's under the same constraint."""
    kw = dict(model="demo", input="Pick one:", max_output_tokens=40)
    for _ in range(3):
        r = client.responses.create(temperature=1.0, extra_body=extra, **kw)
        assert r.status == "completed" and ok(r.output_text), r.output_text
    evs = _events(client.responses.create(temperature=1.0, stream=True, extra_body=extra, **kw))
    streamed = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    assert ok(streamed) and streamed == evs[-1].response.output_text, streamed
    greedy = client.responses.create(temperature=0, extra_body=extra, **kw).output_text
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Pick one:"}],
                                          max_tokens=40, temperature=0, extra_body=chat_extra or extra)
    assert greedy == chat.choices[0].message.content


@pytest.mark.parametrize("extra,param,named", [
    ({"text": {"format": {"type": "json_object"}}, "guided_regex": "a"}, "guided_regex",
     ["text.format", "guided_regex"]),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice",
     ["structured_outputs.regex", "guided_choice"]),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
      "structured_outputs": {"json_object": True}}, "structured_outputs.json_object",
     ["text.format", "structured_outputs.json_object"]),
    ({"guided_regex": "("}, "guided_regex", ["unclosed group"]),
    ({"guided_choice": []}, "guided_choice", ["at least one"]),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", []),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type", ["text.format type 'grammar'"]),
    ({"text": {"format": "json_object"}}, "text.format", ["must be an object"]),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name", ["name"]),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex", ["forced tool call"]),
])
def test_bad_or_doubled_constraints_are_400s_naming_the_fields(client, extra, param, named):
    body = {"model": "demo", "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body=body, cast_to=object)
    err = e.value.body
    assert err["param"] == param and all(n in err["message"] for n in named), err


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "file_search_call"}]}, "input[0].type"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_what_the_server_cannot_do_is_a_400(client, extra, param):
    body = {"model": "demo", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body=body, cast_to=object)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("extra,param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "message", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}, "input[1].role"),
    ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{oops"}]}, "input[0].arguments"),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "tools[0].parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "no spaces", "schema": {}}}}, "text.format.name"),
    ({"input": "hi " * 600}, "input"),                                   # past the 256-token context
    ({"max_output_tokens": 4000}, "max_output_tokens"),
])
def test_bad_input_is_a_400_naming_the_responses_field(client, extra, param):
    """A 400 names the Responses request's own field (input[i], tools[i].name, text.format), in
    its param and its message, never the chat completion's (messages, tools[i].function,
    response_format) that the request becomes."""
    body = {"model": "demo", "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body=body, cast_to=object)
    err = e.value.body
    assert err["param"] == param, err
    assert param in err["message"] or err["code"] == "context_length_exceeded", err
    assert not re.search(r'messages|function\.|"function": \{|response_format|tool_calls|max_tokens', err["message"]), err


def test_thinking_comes_back_as_a_reasoning_item():
    """A reasoning model's chat answer (--reasoning-parser: reasoning_content, then content) as
    the Response's reasoning item before its message, whole and streamed from chat chunks."""
    from exl3tools.server import openai_responses as R

    req = R.ResponsesRequest(model="m", input="hi")
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}
    chat = {"created": 1, "model": "m", "usage": usage, "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Hello.", "reasoning_content": "They greet me."}}]}
    whole = R.from_chat(chat, req, "resp_1")
    assert [o["type"] for o in whole["output"]] == ["reasoning", "message"] and whole["status"] == "completed"
    assert whole["output"][0]["content"][0]["text"] == "They greet me."
    w = R.EventWriter(req, "resp_1", 1, "m")
    evs = w.start()
    for delta, finish in (({"reasoning_content": "They greet"}, None), ({"reasoning_content": " me."}, None),
                          ({"content": "Hello"}, None), ({"content": "."}, "stop")):
        evs += w.feed({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    evs += w.end(usage)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    final = evs[-1]["response"]
    assert [o["content"][0]["text"] for o in final["output"]] == ["They greet me.", "Hello."]
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1]
