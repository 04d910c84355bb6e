"""--reasoning-parser (server/reasoning.py): a reasoning model's <think>...</think> comes back as
message.reasoning_content (streamed as delta.reasoning_content) and the rest as content, whole and
streamed alike, whether the answer opens the thinking or the prompt already did; tool calls are
read after it. Through a real server and the official openai client, a scripted sampler writing
what a reasoning model writes; the splitter alone over every way of cutting an answer into chunks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exl3tools.server.reasoning import ThinkSplitter, opens_inside

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
OPENED = PLAIN + "<think>\n"               # the prompt opens the thinking (DeepSeek-R1's, GLM's way)
HERMES = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools> "
          "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}" + PLAIN)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def ask(client, stream=False, **kw):
    return client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=kw.pop("max_tokens", 150),
                                          temperature=0.5, seed=1, stream=stream, **kw)


def streamed(client, **kw) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of a streamed answer, deltas joined."""
    chunks = [ch for ch in ask(client, stream=True, **kw) if ch.choices]
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    return reasoning, content, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("template, text", [
    (PLAIN, "<think>Two and two.\nFour.</think>\n\nIt is 4."),
    (OPENED, "Two and two.\nFour.</think>\n\nIt is 4."),
])
def test_thinking_comes_apart_from_the_answer(scripted, template, text):
    client = scripted(template, text, reasoning_parser="glm45")
    m = ask(client).choices[0].message
    assert m.reasoning_content == "Two and two.\nFour." and m.content == "It is 4."
    assert streamed(client) == ("Two and two.\nFour.", "It is 4.", "stop")


def test_an_answer_that_does_not_think_is_all_content(scripted):
    client = scripted(PLAIN, "  It is <b>4</b>, not <thin>.", reasoning_parser="think")
    m = ask(client).choices[0].message
    assert m.content == "  It is <b>4</b>, not <thin>." and getattr(m, "reasoning_content", None) is None
    assert streamed(client) == ("", "  It is <b>4</b>, not <thin>.", "stop")


def test_thinking_cut_by_max_tokens_is_all_reasoning(scripted):
    client = scripted(PLAIN, "<think>" + "hmm " * 60 + "</think>4", reasoning_parser="think")
    c = ask(client, max_tokens=20).choices[0]
    assert c.finish_reason == "length" and c.message.content == "" and c.message.reasoning_content.startswith("hmm hmm")
    reasoning, content, finish = streamed(client, max_tokens=20)
    assert (reasoning, content, finish) == (c.message.reasoning_content, "", "length")


def test_without_the_parser_the_tags_stay_in_the_content(scripted):
    text = "<think>Two and two.</think>It is 4."
    m = ask(scripted(PLAIN, text)).choices[0].message
    assert m.content == text and getattr(m, "reasoning_content", None) is None


def test_tool_calls_are_read_after_the_thinking(scripted):
    pytest.importorskip("llguidance")
    text = '<think>I need the weather.</think>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    client = scripted(HERMES, text, reasoning_parser="qwen3")
    tools = [{"type": "function", "function": {"name": "now"}}]
    c = ask(client, tools=tools).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning_content == "I need the weather."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [("now", {})]
    chunks = [ch for ch in ask(client, stream=True, tools=tools) if ch.choices]
    assert "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks) == "I need the weather."
    assert [t.function.name for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])] == ["now"]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks).strip()


def test_a_grammar_held_answer_is_not_split_even_where_the_prompt_opened_thinking(scripted):
    """A forced call (a grammar writes the answer from its first token) under a template that opens
    <think>: the answer is the call, not thinking."""
    pytest.importorskip("llguidance")
    client = scripted(OPENED, '{"name": "now", "arguments": {}}', reasoning_parser="think")
    tools = [{"type": "function", "function": {"name": "now"}}]
    c = ask(client, tools=tools, tool_choice="required").choices[0]
    assert c.finish_reason == "tool_calls" and getattr(c.message, "reasoning_content", None) is None
    assert [t.function.name for t in c.message.tool_calls] == ["now"]


def test_thinking_apart_where_the_tags_are_special_tokens(scripted):
    client = scripted(PLAIN, "<think>Two and two.</think>It is 4.", special=("<think>", "</think>"),
                      reasoning_parser="deepseek_r1")
    m = ask(client).choices[0].message
    assert m.reasoning_content == "Two and two." and m.content == "It is 4."
    assert streamed(client) == ("Two and two.", "It is 4.", "stop")
    assert opens_inside("user: hi\nassistant:<think>\n") and not opens_inside("<think>a</think>assistant:")


ANSWERS = ["<think>a < b, so</think>\n\nb", " \n<think></think>x", "no thought", "<thinking>is not", "<think>cut",
           "a</think>b", "", "  ", "<thi", "<think>x</thi", "<think>x</think>\n"]


@settings(max_examples=300, deadline=None)
@given(text=st.sampled_from(ANSWERS), inside=st.booleans(), cuts=st.lists(st.integers(0, 40), max_size=6))
def test_streamed_chunks_join_to_the_whole_split(text, inside, cuts):
    """However an answer is cut into chunks, the streamed parts join to what the whole answer splits into."""
    whole = ThinkSplitter(inside).split(0, text)
    sp, reasoning, content, at = ThinkSplitter(inside), "", "", 0
    for cut in sorted(cuts) + [len(text)]:
        r, c = sp.feed(0, text[at:max(at, cut)])
        reasoning, content, at = reasoning + r, content + c, max(at, cut)
    r, c = sp.finish(0)
    assert (reasoning + r if whole[0] is not None else None, content + c) == whole


def _gated(special=("<think>", "</think>")):
    """A json_object grammar over the demo's tokenizer with <think> and </think> single tokens,
    and those tokens' ids."""
    pytest.importorskip("llguidance")
    from tokenizers import Tokenizer

    from exl3tools.server.structured import Grammars
    from tests.conftest import DEMO, special_tokens

    tok = Tokenizer.from_str(json.dumps(special_tokens(json.loads((DEMO / "model" / "tokenizer.json").read_text()),
                                                       special)))
    grammar = Grammars(tok.to_str(), [0], tok.get_vocab_size()).schema({"type": "object"}, "response_format")
    return tok, grammar


def test_a_grammar_waits_behind_the_thinking():
    """SamplingParams.think_gate: the first token is the grammar's or <think>; inside the thinking
    nothing is masked and the grammar sees nothing; after </think> the grammar holds."""
    import torch

    from exl3tools.runtime.sampling import Adjust
    from exl3tools.server.protocol import SamplingParams
    from exl3tools.server.reasoning import think_gate

    tok, grammar = _gated()
    gate = think_gate(tok, False)
    open_id, close_id = gate[:2]
    brace = tok.encode("{", add_special_tokens=False).ids[0]
    word = tok.encode("hello", add_special_tokens=False).ids[0]
    n = tok.get_vocab_size()

    def allowed(a) -> set[int]:
        return set(torch.nonzero(torch.isfinite(a.apply(torch.zeros(n)))).flatten().tolist())

    plain = Adjust(SamplingParams(max_tokens=8, grammar=grammar), [], [], n, "cpu")
    assert brace in allowed(plain) and open_id not in allowed(plain) and word not in allowed(plain)
    a = Adjust(SamplingParams(max_tokens=8, grammar=grammar, think_gate=gate), [], [], n, "cpu")
    first = allowed(a)
    assert {open_id, brace} <= first and word not in first
    for t in [open_id, *tok.encode("hello, not JSON", add_special_tokens=False).ids]:
        a.add(t)
        assert len(allowed(a)) == n                 # thinking: nothing masked
    a.add(close_id)
    after = allowed(a)
    assert brace in after and open_id not in after and word not in after
    for t in tok.encode('{"a": 1}', add_special_tokens=False).ids:
        assert t in allowed(a)
        a.add(t)
    assert 0 in allowed(a)                          # the object is complete: EOS
    opened = Adjust(SamplingParams(max_tokens=8, grammar=grammar, think_gate=think_gate(tok, True)), [], [], n, "cpu")
    assert len(allowed(opened)) == n                # the prompt opened the thinking
    from tokenizers import Tokenizer

    from tests.conftest import DEMO

    assert think_gate(Tokenizer.from_file(str(DEMO / "model" / "tokenizer.json")), False) is None   # multi-token tags


def test_structured_output_after_the_thinking(scripted):
    """Served: response_format json_object with the parser on and single-token tags: the thinking
    comes apart and the JSON is the content (the scripted sampler writes both)."""
    pytest.importorskip("llguidance")
    client = scripted(PLAIN, '<think>An object.</think>{"a": 1}', special=("<think>", "</think>"),
                      reasoning_parser="glm45")
    m = ask(client, response_format={"type": "json_object"}).choices[0].message
    assert m.reasoning_content == "An object." and json.loads(m.content) == {"a": 1}
