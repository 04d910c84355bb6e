"""Anthropic's Messages API (POST /v1/messages, server/anthropic_messages.py) through the official
anthropic client against a real server on the demo checkpoint: each answer equals the chat
completion its request amounts to (greedy), streamed events add up to the whole message, forced
tool calls come back as tool_use blocks and their results round-trip, count_tokens counts the
rendered prompt, and errors come in Anthropic's shape."""

from __future__ import annotations

import re

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

TOOL = {"name": "get_weather", "description": "the weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                         "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def clients():
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=256,
                      api_keys=("sk-local",))
    with LiveServer(create_app(cfg)) as s:
        yield (anthropic.Anthropic(base_url=s.url, api_key="sk-local", max_retries=0, timeout=120),
               openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-local", max_retries=0, timeout=120))


def test_a_message_is_the_chat_completion_it_amounts_to(clients):
    claude, oai = clients
    kw = dict(model="demo", max_tokens=8)
    greedy = {"extra_body": {"temperature": 0}}        # (the SDK has no temperature argument)
    m = claude.messages.create(**greedy, system="be brief", messages=[{"role": "user", "content": "Say hi"}], **kw)
    chat = oai.chat.completions.create(messages=[{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "Say hi"}], temperature=0, **kw)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens"
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    # text blocks and a system prompt as blocks: the same prompt
    blocks = claude.messages.create(**greedy, system=[{"type": "text", "text": "be brief"}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}], **kw)
    assert blocks.content[0].text == m.content[0].text
    with claude.messages.stream(**greedy, system="be brief", messages=[{"role": "user", "content": "Say hi"}], **kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == m.usage.output_tokens
    n = claude.messages.count_tokens(model="demo", system="be brief", messages=[{"role": "user", "content": "Say hi"}])
    assert n.input_tokens == m.usage.input_tokens
    long = claude.messages.count_tokens(model="demo", messages=[{"role": "user", "content": "word " * 400}])
    assert long.input_tokens > 256          # past the server's context: counted, not refused


def test_forced_tool_use_round_trips(clients):
    claude, oai = clients
    kw = dict(model="demo", max_tokens=60, tools=[TOOL], extra_body={"temperature": 0})
    m = claude.messages.create(messages=[{"role": "user", "content": "weather?"}],
                               tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    assert set(uses[0].input) == {"city"} and uses[0].id
    with claude.messages.stream(messages=[{"role": "user", "content": "weather?"}], tool_choice={"type": "any"}, **kw) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]
    u = uses[0]
    back = claude.messages.create(model="demo", max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": u.id, "name": u.name, "input": u.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny"}]}])
    import json

    chat = oai.chat.completions.create(model="demo", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}]},
        {"role": "tool", "tool_call_id": u.id, "content": "sunny"}])
    assert back.content[0].text == chat.choices[0].message.content


def test_a_stop_sequence_is_named(clients):
    """The stop string that ended an answer: Anthropic's stop_reason "stop_sequence" with the
    string, whole and streamed, and the chat choice's stop_reason (vLLM's field)."""
    claude, oai = clients
    kw = dict(model="demo", max_tokens=16, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "hi"}])
    full = claude.messages.create(**kw).content[0].text
    # the first 3-character piece past the start that occurs nowhere before it
    at = next(i for i in range(3, len(full) - 3) if full[i:i + 3] not in full[:i + 2])
    stop = full[at:at + 3]
    m = claude.messages.create(stop_sequences=[stop, "never here"], **kw)
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", stop, full[:at])
    with claude.messages.stream(stop_sequences=[stop], **kw) as st:
        final = st.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    chat = oai.chat.completions.create(model="demo", max_tokens=16, temperature=0, stop=[stop],
                                       messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].model_extra["stop_reason"] == stop
    assert claude.messages.create(**kw).stop_sequence is None


def test_streamed_usage_equals_the_whole_messages_with_prefix_cache_hits(clients):
    """message_start goes out before the prefix cache is consulted: the stream's last usage
    (message_delta, cumulative as Anthropic's) must carry the input counts the whole message has."""
    claude, _ = clients
    kw = dict(model="demo", max_tokens=3, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "a prompt long enough to fill two cache blocks " * 2}])
    claude.messages.create(**kw)                 # warms the prefix cache
    whole = claude.messages.create(**kw)
    assert whole.usage.cache_read_input_tokens >= 16
    with claude.messages.stream(**kw) as s:
        streamed = s.get_final_message().usage
    assert (streamed.input_tokens, streamed.cache_read_input_tokens, streamed.output_tokens) == (
        whole.usage.input_tokens, whole.usage.cache_read_input_tokens, whole.usage.output_tokens)


def test_output_config_format_holds_the_answer_to_a_schema(clients):
    import json

    claude, _ = clients
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    m = claude.messages.create(model="demo", max_tokens=30, messages=[{"role": "user", "content": "json"}],
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               extra_body={"temperature": 0})
    assert m.stop_reason == "end_turn" and 0 <= json.loads(m.content[0].text)["a"] <= 9


CHOICES = ["red", "green", "blue", "a.b*c"]
TRIPLE = r"[0-9]{3}-[a-z]{2}"


@pytest.mark.parametrize("extra,ok", [
    ({"guided_choice": CHOICES}, CHOICES.__contains__),
    ({"structured_outputs": {"choice": CHOICES}}, CHOICES.__contains__),
    ({"guided_regex": TRIPLE}, lambda t: re.fullmatch(TRIPLE, t)),
    ({"structured_outputs": {"regex": TRIPLE}}, lambda t: re.fullmatch(TRIPLE, t)),
])
def test_vllm_constraints_hold_the_answer(clients, extra, ok):
    """vLLM's structured_outputs / guided_* (Anthropic has no such field) hold the message's text,
    sampled, whole and streamed; greedy, it is the chat completion's under the same constraint;
    count_tokens takes them and counts the same prompt."""
    claude, oai = clients
    kw = dict(model="demo", max_tokens=40, messages=[{"role": "user", "content": "Pick one:"}])
    for _ in range(3):
        m = claude.messages.create(extra_body={**extra, "temperature": 1.0}, **kw)
        assert m.stop_reason == "end_turn" and ok(m.content[0].text), m.content
    with claude.messages.stream(extra_body={**extra, "temperature": 1.0}, **kw) as st:
        streamed = "".join(st.text_stream)
        assert ok(streamed) and st.get_final_message().stop_reason == "end_turn", streamed
    greedy = claude.messages.create(extra_body={**extra, "temperature": 0}, **kw)
    chat = oai.chat.completions.create(temperature=0, extra_body=extra, **kw)
    assert greedy.content[0].text == chat.choices[0].message.content
    counted = claude.messages.count_tokens(model="demo", messages=kw["messages"], extra_body=extra)
    assert counted.input_tokens == greedy.usage.input_tokens


@pytest.mark.parametrize("extra,named", [
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}, "guided_regex": "a"},
     ["output_config.format", "guided_regex"]),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, ["structured_outputs.regex", "guided_choice"]),
    ({"structured_outputs": {"choice": ["a"], "json_object": True}},
     ["structured_outputs.json_object", "structured_outputs.choice"]),
    ({"guided_regex": "("}, ["guided_regex", "unclosed group"]),
    ({"guided_choice": []}, ["guided_choice", "at least one"]),
    ({"tools": [TOOL], "tool_choice": {"type": "any"}, "guided_regex": "a"}, ["forced tool call", "guided_regex"]),
])
def test_bad_or_doubled_constraints_are_400s_naming_the_fields(clients, extra, named):
    claude, _ = clients
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="demo", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               extra_body=extra)
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert all(n in err["error"]["message"] for n in named), err


def test_errors_come_in_anthropics_shape(clients):
    claude, _ = clients
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="demo", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].type" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    bad = anthropic.Anthropic(base_url=str(claude.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="demo", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("extra,named", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "input": {}}]}]}, "messages[1].content[0].name"),
    ({"tools": [{"name": "no spaces", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "f", "input_schema": "{}"}]}, "tools[0].input_schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
])
def test_bad_input_is_a_400_naming_the_messages_field(clients, extra, named):
    """A 400's message names the Messages request's own field (messages[i].content[j].name,
    tools[i].input_schema), never the chat completion's that the request becomes."""
    claude, _ = clients
    body = {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.post("/v1/messages", body=body, cast_to=object)
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert named in err["error"]["message"], err
    assert not re.search(r'function|tool_calls|parameters|response_format', err["error"]["message"]), err


def test_thinking_comes_back_as_a_thinking_block():
    """A reasoning model's chat answer (--reasoning-parser: reasoning_content, then content) as a
    thinking block before the text, whole and streamed from chat chunks."""
    from exl3tools.server import anthropic_messages as A

    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}
    chat = {"model": "m", "usage": usage, "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Hello.", "reasoning_content": "They greet me."}}]}
    m = A.from_chat(chat, "msg_1")
    assert [b["type"] for b in m["content"]] == ["thinking", "text"] and m["stop_reason"] == "end_turn"
    w = A.EventWriter("msg_1", "m", 3)
    evs = w.start()
    for delta, finish in (({"reasoning_content": "They greet"}, None), ({"content": "Hello."}, "stop")):
        evs += w.feed({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    evs += w.end(usage)
    assert [(e["type"], e.get("index"), (e.get("delta") or {}).get("type")) for e in evs] == [
        ("message_start", None, None), ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert evs[-2]["delta"]["stop_reason"] == "end_turn" and evs[-2]["usage"]["output_tokens"] == 5
