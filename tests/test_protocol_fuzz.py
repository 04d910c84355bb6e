"""Property-based fuzzing of the request parser (exl3tools/server/protocol.py), issue 16: any bytes,
any JSON body, either parse into a request (and then pass or fail the checks the routes run
before tokenizing) or raise the API's 4xx error; never another exception, and never an error or
request that cannot itself be encoded as UTF-8 JSON. Fixed budget: derandomized, a few hundred
examples, seconds."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from exl3tools.server.protocol import (  # noqa: E402
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_chat_extras,
    check_completion_extras,
    completion_prompts,
    message_dicts,
    parse_body,
    sampling_params,
)
from exl3tools.server.structured import output_constraint  # noqa: E402

BUDGET = dict(derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CLASSES = [CompletionRequest, ChatCompletionRequest]
FIELDS = sorted({*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields,
                 "stop_sequence", "skip_special_tokens"})

# Strings with what used to break things: lone surrogates, NUL, escapes, long runs.
text = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfff", "\x00", "demo", "", " " * 40,
                                                        "user", "assistant", "text", "auto", "none"]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-3, 5),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-46, 1e-30, 5e-324]),
                    text)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(text, c, max_size=4),
                           max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
                                optional={"content": st.one_of(text, st.lists(st.fixed_dictionaries(
                                    {"type": st.just("text"), "text": text}), max_size=2)), "name": text})
# A valid base with a few fields replaced or added: most bodies get past the JSON and type checks.
BASE = [{"model": "demo", "prompt": "hi"}, {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}]
mutations = st.dictionaries(st.sampled_from(FIELDS), st.one_of(json_values, st.lists(message, max_size=2)),
                            max_size=3)


def exercise(raw: bytes, cls: type) -> None:
    """What the routes do with a body before any tokenization: parse, then the pure checks."""
    try:
        req = parse_body(raw, cls)
        if cls is CompletionRequest:
            check_completion_extras(req)
            completion_prompts(req)
        else:
            check_chat_extras(req)
            message_dicts(req)
        output_constraint(req)
        sampling_params(req, max_tokens=1, logprobs=None, vocab_size=2048)
    except APIError as exc:
        assert exc.status in (400, 413), exc.status
        assert exc.body()["error"]["message"]
        json.dumps(exc.body(), ensure_ascii=False).encode("utf-8")  # the answer itself must encode
        return
    json.dumps(req.model_dump(), ensure_ascii=False).encode("utf-8")  # no surrogate got through


@settings(max_examples=250, **BUDGET)
@given(changes=mutations, chat=st.booleans())
def test_any_json_body_parses_or_is_a_4xx(changes, chat):
    exercise(json.dumps({**BASE[chat], **changes}).encode(), CLASSES[chat])


@settings(max_examples=100, **BUDGET)
@given(raw=st.one_of(st.binary(max_size=64), st.builds(lambda v: json.dumps(v).encode(), json_values)),
       chat=st.booleans())
def test_any_bytes_parse_or_are_a_4xx(raw, chat):
    exercise(raw, CLASSES[chat])


@settings(max_examples=40, **BUDGET)
@given(field=st.sampled_from(["max_tokens", "seed", "n", "prompt", "temperature", "unknown"]),
       digits=st.integers(1, 6000), sign=st.sampled_from(["", "-"]), chat=st.booleans())
def test_integer_literals_of_any_length_parse_or_are_a_4xx(field, digits, sign, chat):
    base = '"messages": [{"role": "user", "content": "hi"}]' if chat else '"prompt": "hi"'
    raw = f'{{"model": "demo", {base}, "{field}": {sign}{"9" * digits}}}'.encode()
    exercise(raw, CLASSES[chat])


def test_long_integer_check_runs_only_where_a_long_digit_run_is():
    """parse_body skips its per-literal integer hook unless the body holds a run of more than
    MAX_INT_DIGITS digits: 100 digits parse as an int, 101 are refused naming the field, and a long
    run inside a string takes the checked path and parses as before."""
    from exl3tools.server import protocol as P

    ok = P.parse_body(b'{"model": "m", "prompt": [1, ' + b"9" * 100 + b"]}", P.CompletionRequest)
    assert ok.prompt == [1, int("9" * 100)]
    with pytest.raises(P.APIError) as e:
        P.parse_body(b'{"model": "m", "prompt": [1, ' + b"9" * 101 + b"]}", P.CompletionRequest)
    assert e.value.status == 400 and e.value.param == "prompt.1" and "101 digits" in e.value.message
    text = P.parse_body(b'{"model": "m", "prompt": "' + b"7" * 300 + b'", "max_tokens": 5}', P.CompletionRequest)
    assert text.prompt == "7" * 300 and text.max_tokens == 5
