"""Incremental detokenisation and stop strings (the part of streaming that is easy to get wrong)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from tokenizers import Tokenizer  # noqa: E402

from exl3tools.server.detok import TextTracker, TokenText  # noqa: E402
from exl3tools.server.protocol import APIError  # noqa: E402
from exl3tools.server.template import ChatTemplate  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

TEXT = "Hello world, héllo 你好 🎉 done."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO / "model" / "tokenizer.json"))


def feed(tok, ids, stops=()):
    tr, parts, hit = TextTracker(tok, stops), [], False
    for i in ids:
        out, hit = tr.add(i)
        parts.append(out)
        if hit:
            break
    if not hit:
        parts.append(tr.flush())
    return parts, hit


def test_deltas_concatenate_to_the_full_decode(tok):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    parts, hit = feed(tok, ids)
    assert not hit and "".join(parts) == tok.decode(ids)
    assert not any("\ufffd" in p for p in parts)  # multi-byte characters are never split


def test_random_token_streams_match_decode(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(6, tok.get_vocab_size()) for _ in range(30)]
        parts, _ = feed(tok, ids)
        assert "".join(parts) == tok.decode(ids)


@pytest.mark.parametrize("stop", ["d, hé", "你", "🎉", "done.", "ld"])
def test_stop_string_across_token_boundaries(tok, stop):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    full = tok.decode(ids)
    parts, hit = feed(tok, ids, (stop,))
    assert hit and "".join(parts) == full[: full.index(stop)]


def test_stop_prefix_is_held_back_then_released(tok):
    ids = tok.encode("abc abd", add_special_tokens=False).ids
    parts, hit = feed(tok, ids, ("abx",))
    assert not hit and "".join(parts) == tok.decode(ids)
    tr = TextTracker(tok, ("c abz",))
    released = "".join(tr.add(i)[0] for i in tok.encode("abc ab", add_special_tokens=False).ids)
    assert released == "ab"  # "c ab" could still become the stop string


def test_earliest_of_several_stops_wins(tok):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    parts, hit = feed(tok, ids, ("done", "world"))
    assert hit and "".join(parts) == "Hello "


def test_token_text_bytes(tok):
    tt = TokenText(tok)
    for i in tok.encode(TEXT, add_special_tokens=False).ids:
        s, raw = tt.get(i)
        assert s == raw.decode() if not s.startswith("bytes:") else s == "bytes:" + "".join(
            f"\\x{b:02x}" for b in raw)
    joined = b"".join(tt.get(i)[1] for i in tok.encode(TEXT, add_special_tokens=False).ids)
    assert joined.decode() == TEXT


def test_template_refusal_and_errors_are_400():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                     "{% endif %}{{ messages | tojson }}")
    assert t.render([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]'
    with pytest.raises(APIError) as e:
        t.render([{"role": "assistant", "content": "x"}])
    assert e.value.status == 400 and "first must be user" in e.value.message
    with pytest.raises(APIError):
        ChatTemplate("{{ messages[5]['content'].upper() }}").render([])
    sandboxed = ChatTemplate("{{ ''.__class__.__mro__ }}")
    with pytest.raises(APIError):
        sandboxed.render([])


def test_sse_orjson_writes_what_json_would():
    """The stream's chunks go through orjson (responses.sse): the same bytes as json.dumps for every
    ASCII character, unicode line separators, emoji and a lone replacement character; a chunk with
    logprobs (a -inf one included) and an integer beyond 2^53 take json's path."""
    import json

    from exl3tools.server.responses import sse

    def plain(obj):
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    text = "".join(map(chr, range(128))) + "é\u2028\u2029\ufffd😀\x7f"
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    assert sse(chunk) == plain(chunk)
    lp = {"choices": [{"logprobs": {"token_logprobs": [-0.5, float("-inf")]}}]}
    assert sse(lp, True) == plain(lp) and "-Infinity" in sse(lp, True)
    big = {"seed": 2**60}
    assert sse(big) == plain(big)
