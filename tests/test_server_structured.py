"""Structured outputs (response_format json_object / json_schema on chat and completions, server/structured.py)
through a real server and the official openai client on the demo checkpoint: the answers parse and
follow their schema, greedy answers equal a greedy decode of the plain runtime whose logits are
masked by llguidance written out here, and bad formats are 400s naming the parameter."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
llg = pytest.importorskip("llguidance")

import torch  # noqa: E402

from exl3tools.runtime.runner import load_runner  # noqa: E402
from exl3tools.runtime.sampling import Adjust  # noqa: E402
from exl3tools.server.protocol import SamplingParams  # noqa: E402
from exl3tools.server.structured import JSON_OPTIONS  # noqa: E402
from exl3tools.server.template import ChatTemplate  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "tag": {"enum": ["red", "green", "blue"]}}}


def _fmt(schema=SCHEMA, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _follows(obj) -> bool:
    return (set(obj) == {"ok", "n", "tag"} and isinstance(obj["ok"], bool) and isinstance(obj["n"], int)
            and 0 <= obj["n"] <= 9 and obj["tag"] in ("red", "green", "blue"))


@pytest.fixture(scope="module")
def client(demo_openai):
    return demo_openai


def chat(client, **kw):
    return client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=kw.pop("max_tokens", 60), **kw)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_answers_parse_and_follow_the_schema(client, temperature):
    r = chat(client, temperature=temperature, seed=5, n=2, response_format=_fmt())
    for c in r.choices:
        assert c.finish_reason == "stop", c
        assert _follows(json.loads(c.message.content)), c.message.content
        assert c.message.content.startswith('{"ok": ')      # OpenAI's compact layout, the schema's order


def test_json_schema_streams_the_same_answer(client):
    whole = chat(client, temperature=0.7, seed=11, response_format=_fmt()).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in chat(client, temperature=0.7, seed=11, stream=True,
                                                               response_format=_fmt()) if ch.choices]
    assert "".join(parts) == whole and _follows(json.loads(whole))


def test_json_object_answers_parse(client):
    c = chat(client, temperature=0, response_format={"type": "json_object"}).choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


def test_greedy_equals_the_runtime_masked_by_llguidance(client):
    """The served greedy tokens = the plain runtime's greedy decode where, before every argmax,
    every token llguidance's matcher does not allow is dropped (its numpy helpers, not ours)."""
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

    r = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=60, temperature=0,
                                       response_format=_fmt(), extra_body={"return_token_ids": True})
    served = r.choices[0].model_dump()["token_ids"]
    with load_runner(str(DEMO / "model"), max_cache_tokens=512) as run:
        text = ChatTemplate(run.chat_template, bos_token=run.bos_token or "",
                            eos_token=run.eos_token or "").render(MESSAGES, add_generation_prompt=True)
        prompt = run.tokenizer.encode(text, add_special_tokens=False).ids
        tok = llg.LLTokenizer(run.tokenizer.to_str(), n_vocab=run.vocab_size, eos_token=sorted(run.eos_token_ids))
        m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS))
        mask = allocate_token_bitmask(1, run.vocab_size)
        run.add_sequence("ref")
        out, new = [], prompt
        for _ in range(60):
            row = run.step([("ref", new)])[0].float().numpy()[None].copy()
            fill_next_token_bitmask(m, mask, 0)
            apply_token_bitmask_inplace(row, mask)
            t = int(np.argmax(row[0]))
            out.append(t)
            if t in run.eos_token_ids:
                break
            m.consume_token(t)
            new = [t]
    assert out[-1] in run.eos_token_ids and served in (out, out[:-1]), (served, out)


@pytest.mark.parametrize("fmt,param,code", [
    (_fmt({"type": "nonsense"}), "response_format", "invalid_value"),
    ({"type": "grammar"}, "response_format.type", "unsupported_parameter"),
    ({"type": "json_schema"}, "response_format.json_schema", "invalid_value"),
    (_fmt(name="has space"), None, None),
])
def test_bad_formats_are_400s_naming_the_parameter(client, fmt, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=4, response_format=fmt)
    err = e.value.body
    if param is not None:
        assert (err["param"], err["code"]) == (param, code), err
    else:
        assert "name" in err["message"] or "pattern" in err["message"], err


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 3}])
def test_a_grammar_with_ignore_eos_or_min_tokens_is_refused(client, extra):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=8, response_format=_fmt(), extra_body=extra)
    assert e.value.body["param"] == "response_format"


def test_a_plain_completion_takes_response_format_as_vllm_does(client):
    """/v1/completions with response_format (vLLM's extension): each of n answers, streamed or not,
    parses and follows the schema; its bad formats are the same 400s as chat's."""
    kw = dict(model="demo", prompt="The sky, as JSON:", max_tokens=60, extra_body={"response_format": _fmt()})
    r = client.completions.create(temperature=1.0, seed=3, n=2, **kw)
    for c in r.choices:
        assert c.finish_reason == "stop" and _follows(json.loads(c.text)), c
    parts = [ch.choices[0].text for ch in client.completions.create(temperature=0, stream=True, **kw) if ch.choices]
    assert _follows(json.loads("".join(parts)))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="x", max_tokens=4, extra_body={"response_format": {"type": "grammar"}})
    assert (e.value.body["param"], e.value.body["code"]) == ("response_format.type", "unsupported_parameter")


def test_adjust_masks_what_the_constraint_forbids_and_tells_it_each_token():
    """runtime.sampling.Adjust with a stand-in constraint: allowed ids 3 and 33 (past one 32-bit word),
    ids past the constraint's words not allowed; add() reaches consume()."""
    seen = []

    class Constraint:
        def allowed(self):
            return (torch.tensor([1 << 3, 1 << 1], dtype=torch.int32)).numpy().tobytes()

        def consume(self, t):
            seen.append(t)

    class Grammar:
        def matcher(self):
            return Constraint()

    a = Adjust(SamplingParams(max_tokens=4, grammar=Grammar()), [1, 2], [], 70, "cpu")
    x = a.apply(torch.zeros(70))
    assert torch.isfinite(x).nonzero().flatten().tolist() == [3, 33]
    a.add(33)
    assert seen == [33] and a.n_out == 1


def test_without_llguidance_a_structured_request_is_a_400(monkeypatch):
    """llguidance comes with the serve extra; a server installed without it answers such requests
    with a 400 that says what to install, and everything else as before."""
    import sys

    from exl3tools.server import structured
    from exl3tools.server.protocol import APIError

    monkeypatch.setitem(sys.modules, "llguidance", None)        # import llguidance -> ImportError
    with pytest.raises(APIError) as e:
        structured.Grammars("{}", [0], 8)
    assert e.value.status == 400 and "exl3tools[serve]" in str(e.value) and e.value.param == "response_format"
    with pytest.raises(APIError) as e:     # the field the request asked with (Server.grammars)
        structured.Grammars("{}", [0], 8, "guided_regex")
    assert e.value.param == "guided_regex"


# ------------------------------------------------ vLLM's structured_outputs and guided_* fields

CHOICES = ["red", "green", "blue", "a.b*c", 'say "hi" \\ [x]', "two\nlines"]
TRIPLE = r"[0-9]{3}-[a-z]{2}"
LARK = 'start: "The answer is " NUM "."\nNUM: /[1-9][0-9]?/'


def complete(client, extra, **kw):
    return client.completions.create(model="demo", prompt=kw.pop("prompt", "Pick one:"),
                                     max_tokens=kw.pop("max_tokens", 24), extra_body=extra, **kw)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_choice_answers_are_exactly_one_of_the_choices(client, seed):
    for extra in ({"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}):
        r = chat(client, temperature=1.0, seed=seed, n=2, extra_body=extra)
        c = complete(client, extra, temperature=1.0, seed=seed, n=2)
        answers = [x.message.content for x in r.choices] + [x.text for x in c.choices]
        assert all(a in CHOICES for a in answers), answers
        assert {x.finish_reason for x in (*r.choices, *c.choices)} == {"stop"}


def test_choices_are_matched_literally():
    """A choice's regex or Lark metacharacters, quotes, backslashes and newlines are literal: the
    grammar accepts each choice's tokens and nothing that only a pattern would match."""
    from tokenizers import Tokenizer

    from exl3tools.server.structured import Constraint, Grammars

    tj = (DEMO / "model" / "tokenizer.json").read_text()
    tok = Tokenizer.from_str(tj)
    grammar = Grammars(tj, [0], tok.get_vocab_size(with_added_tokens=True)).compile(
        Constraint("choice", CHOICES, "guided_choice"))

    def accepts(text):
        m = grammar.proto.deep_copy()
        return m.consume_tokens(tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()

    assert all(accepts(c) for c in CHOICES)
    assert not any(accepts(t) for t in ["aXbc", "a.bbc", "ab*c", "re", "redd", 'say "hi" \\ x', "two lines"])


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": TRIPLE}}, {"guided_regex": TRIPLE}])
def test_regex_answers_fully_match(client, extra):
    for seed in (4, 5):
        answers = [x.message.content for x in chat(client, temperature=1.0, seed=seed, n=2, extra_body=extra).choices]
        answers += [x.text for x in complete(client, extra, temperature=1.0, seed=seed, n=2).choices]
        assert all(re.fullmatch(TRIPLE, a) for a in answers), answers


@pytest.mark.parametrize("extra,pattern", [
    ({"structured_outputs": {"grammar": LARK}}, r"The answer is [1-9][0-9]?\."),
    ({"guided_grammar": LARK}, r"The answer is [1-9][0-9]?\."),
    ({"guided_grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'}, r"yes|no|maybe [0-9]"),   # GBNF
])
def test_grammar_answers_follow_the_grammar(client, extra, pattern):
    for seed in (6, 7):
        r = chat(client, temperature=1.0, seed=seed, n=2, extra_body=extra)
        c = complete(client, extra, temperature=1.0, seed=seed)
        answers = [x.message.content for x in r.choices] + [c.choices[0].text]
        assert all(re.fullmatch(pattern, a) for a in answers), answers
        assert {x.finish_reason for x in (*r.choices, *c.choices)} == {"stop"}


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": json.dumps(SCHEMA)}},
    {"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
])
def test_json_schemas_by_vllm_field(client, extra):
    c = chat(client, temperature=1.0, seed=8, extra_body=extra).choices[0]
    assert c.finish_reason == "stop" and _follows(json.loads(c.message.content)), c.message.content
    assert _follows(json.loads(complete(client, extra, max_tokens=60, temperature=0).choices[0].text))


def test_json_object_by_structured_outputs(client):
    c = chat(client, temperature=0, extra_body={"structured_outputs": {"json_object": True}}).choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": TRIPLE}}, {"guided_choice": CHOICES},
                                   {"guided_grammar": LARK}])
def test_constrained_answers_stream_the_same_text(client, extra):
    whole = chat(client, temperature=1.0, seed=9, extra_body=extra).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in chat(client, temperature=1.0, seed=9, stream=True,
                                                               extra_body=extra) if ch.choices]
    assert "".join(parts) == whole
    text = complete(client, extra, temperature=1.0, seed=9).choices[0].text
    assert "".join(ch.choices[0].text for ch in complete(client, extra, temperature=1.0, seed=9, stream=True)
                   if ch.choices) == text


@pytest.mark.parametrize("extra,param,named", [
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs.choice",
     ["structured_outputs.regex", "structured_outputs.choice"]),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice",
     ["structured_outputs.regex", "guided_choice"]),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json",
     ["response_format", "guided_json"]),
    ({"guided_regex": "(", }, "guided_regex", ["unclosed group"]),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex", ["regex"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["at least one"]),
    ({"guided_choice": []}, "guided_choice", ["at least one"]),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", ["undefined_rule"]),
    ({"structured_outputs": {"grammar": "root ::: ("}}, "structured_outputs.grammar", ["GBNF"]),
    ({"guided_json": "{not json"}, "guided_json", ["not valid JSON"]),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", ["JSON object"]),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice", []),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", []),
    ({"guided_regex": "a", "ignore_eos": True}, "guided_regex", ["ignore_eos"]),
    ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 2}, "structured_outputs.choice", ["min_tokens"]),
])
def test_bad_constraints_are_400s_naming_the_field(client, extra, param, named):
    for call in (lambda: chat(client, max_tokens=4, extra_body=extra), lambda: complete(client, extra, max_tokens=4)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        err = e.value.body
        assert err["param"] == param and all(n in err["message"] for n in named), err


def test_a_forced_tool_call_with_a_constraint_is_refused(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=8, tools=[tool], tool_choice="required", extra_body={"guided_regex": "a"})
    assert e.value.body["param"] == "guided_regex"
