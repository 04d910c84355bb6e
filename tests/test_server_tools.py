"""Tool calls (chat's tools, server/tools.py) through a real server and the official openai client
on the demo checkpoint. Forced (tool_choice "required" or a named function): the call comes back
as message.tool_calls with arguments that follow the tool's parameters, streamed as one delta.
"auto": the model's own syntax (Hermes JSON blocks, GLM pairs), written by a scripted sampler,
read out of the answer. What cannot be served is a 400 naming the parameter; tools and past calls
reach the template."""

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


# ---------------------------------------------------------------- tool_choice "auto"
HERMES = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools> Call one as "
          "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
          "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
GLM = HERMES.replace("{\"name\": ..., \"arguments\": ...}", "name<arg_key>k</arg_key><arg_value>v</arg_value>")
# DeepSeek's markers as its templates write them (｜ U+FF5C, ▁ U+2581)
DEEPSEEK = HERMES.replace("<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>",
                          "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name ...<｜tool▁call▁end｜>"
                          "<｜tool▁calls▁end｜>")


def test_auto_reads_a_hermes_call_and_keeps_the_text_before_it(scripted):
    c = scripted(HERMES, 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>')
    m = call(c, temperature=0.5, seed=1, max_tokens=150).choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content == "Let me check."
    (tc,) = m.message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Rome", "days": 2}


def test_auto_streams_the_text_and_then_the_calls(scripted):
    text = 'Two calls.<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
           '"arguments": {"city": "Paris", "days": 1}}</tool_call>'
    chunks = [ch for ch in call(scripted(HERMES, text), temperature=0.5, seed=1, stream=True, max_tokens=150) if ch.choices]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert content == "Two calls." and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "now", {}), (1, "get_weather", {"city": "Paris", "days": 1})]
    assert not any("<tool" in (ch.choices[0].delta.content or "") for ch in chunks)


def test_auto_reads_glm_pairs_with_the_parameters_types(scripted):
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    m = call(scripted(GLM, text), temperature=0.5, seed=1, max_tokens=150).choices[0]
    (tc,) = m.message.tool_calls
    assert m.message.content is None and json.loads(tc.function.arguments) == {"city": "Rome", "days": 2}


@pytest.mark.parametrize("body", [
    'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome", "days": 2}\n```',      # V3 (0324)
    'get_weather<｜tool▁sep｜>{"city": "Rome", "days": 2}'])                                # V3.1 and later
def test_auto_reads_deepseek_calls_streamed_and_whole(scripted, body):
    text = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + body + "<｜tool▁call▁end｜>"
            '<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    client = scripted(DEEPSEEK, text)
    m = call(client, temperature=0.5, seed=1, max_tokens=220).choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content == "Checking."
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in m.message.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("now", {})]
    chunks = [ch for ch in call(client, temperature=0.5, seed=2, stream=True, max_tokens=220) if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Checking."
    assert [tc.function.name for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])] == ["get_weather", "now"]


NOW_CALL = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("text,content", [
    ("Sure! " + NOW_CALL, "Sure!"),                           # the space before the call is dropped
    ("\n\n" + NOW_CALL + "\n", None),                          # whitespace alone is no content
    ("Sure! " + NOW_CALL + "\nDone. ", "Sure!\nDone."),          # text after the calls kept
    ("It is sunny.  \n", "It is sunny.  \n"),                    # no call: the answer as written
])
def test_auto_content_is_the_same_streamed_and_whole(scripted, text, content):
    """An "auto" answer's content streamed adds up to the whole answer's: whitespace before a call
    (and at the answer's end) is dropped from both, the stream holding it back until text follows."""
    client = scripted(HERMES, text)
    m = call(client, temperature=0.5, seed=1, max_tokens=150).choices[0]
    chunks = [ch for ch in call(client, temperature=0.5, seed=2, stream=True, max_tokens=150) if ch.choices]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert m.message.content == content and streamed == (content or ""), (m.message.content, streamed)
    calls = [tc.function.name for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls == [tc.function.name for tc in m.message.tool_calls or []]


@pytest.mark.parametrize("family,call_text", [
    ("hermes", NOW_CALL), ("glm", "<tool_call>now\n</tool_call>"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_streamed_auto_content_equals_the_whole_for_every_chunking(family, call_text, finish):
    """CallReader's streamed content (feed, then finish) against its whole message for answers cut
    into chunks every way (one cut, and every character alone), calls or none, cut or not."""
    from exl3tools.server.tools import CallReader, CallSyntax, ToolMode

    mode = ToolMode(syntax=CallSyntax(family))
    texts = [f"Sure! {call_text}", f" \n{call_text}\n", f"Sure!\t{call_text} then {call_text}  ok \n",
             f"a  {call_text[:-1]}", "plain  ", "  ", f"x {call_text[:5]}  y ", f"{call_text}"]
    for text in texts:
        whole, _ = CallReader(mode).message(text, finish)
        for cuts in [[k] for k in range(len(text) + 1)] + [list(range(1, len(text)))]:
            reader, sent, at = CallReader(mode), "", 0
            for k in [*cuts, len(text)]:
                sent += reader.feed(0, text[at:k])
                at = k
            last, _ = reader.finish(0, finish)
            assert sent + last.get("content", "") == (whole["content"] or ""), (text, cuts)


def test_deepseek_blocks_that_do_not_parse_leave_the_answer_text():
    from exl3tools.server.tools import CallSyntax

    ds = CallSyntax("deepseek")
    begin = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    for body in ("get_weather{}", "function<｜tool▁sep｜>get_weather {}", "x<｜tool▁sep｜>[1]", "<｜tool▁sep｜>{}"):
        assert ds.parse(begin + body + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>") is None, body
    assert ds.parse("no calls here") is None


@pytest.mark.parametrize("text", ["It is sunny, <tool_calm> and <tool_ans.",
                                  '<tool_call>{"name": "now", "arguments": {}</tool_call>'])  # not JSON: text
def test_auto_answers_without_a_readable_call_are_text(scripted, text):
    client = scripted(HERMES, text)
    m = call(client, temperature=0.5, seed=1, max_tokens=150).choices[0]
    assert m.finish_reason == "stop" and m.message.content == text and not m.message.tool_calls
    chunks = [ch for ch in call(client, temperature=0.5, seed=2, stream=True, max_tokens=150) if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text


def test_auto_reads_markers_that_are_special_tokens(scripted):
    """A tokenizer whose <tool_call> and </tool_call> are special tokens (detokenizing skips those):
    the server decodes these answers with the markers as text, so the call is still read."""
    from exl3tools.server.tools import call_syntax

    assert call_syntax(HERMES).family == "hermes" and call_syntax(GLM).family == "glm"
    assert call_syntax(DEEPSEEK).family == "deepseek" and call_syntax("{{ messages }}") is None
    text = 'Sure.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    client = scripted(HERMES, text, special=("<tool_call>", "</tool_call>"))
    m = call(client, temperature=0.5, seed=1, max_tokens=150).choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content == "Sure."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls] == [("now", {})]


def test_keeping_decodes_special_markers_as_text():
    from tokenizers import Tokenizer

    from exl3tools.server.detok import keeping
    from tests.conftest import DEMO, special_tokens

    tok = Tokenizer.from_str(json.dumps(special_tokens(json.loads((DEMO / "model" / "tokenizer.json").read_text()),
                                                       ("<tool_call>", "</tool_call>"))))
    ids = tok.encode("a<tool_call>b</tool_call>", add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=True) == "ab"
    kept = keeping(tok, frozenset({"<tool_call>", "</tool_call>"}))
    assert kept.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call>"
    assert kept.encode("a<tool_call>b</tool_call>", add_special_tokens=False).ids == ids
    assert keeping(tok, frozenset({"<think>"})) is tok
