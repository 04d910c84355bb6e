"""Structured outputs: chat's ``response_format`` of type ``json_object`` or ``json_schema`` (and
forced tool calls, server/tools.py) as a grammar that masks every step's logits (llguidance,
imported lazily).

The request's schema is compiled and checked against the model's tokenizer when the request is
prepared (a bad schema is a 400 naming ``response_format``); each choice then gets its own matcher
(``Grammar.matcher``), which ``runtime.sampling.Adjust`` asks for the allowed tokens before every
draw and tells every token drawn. JSON comes out compact, as OpenAI's does (", " and ": " between
items, no other whitespace): with llguidance's default flexible whitespace a model can emit blanks
forever; a schema's ``x-guidance`` options override that. Once the grammar is complete only EOS is
allowed, so the choice ends with ``finish_reason`` "stop".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from exl3tools.server.protocol import APIError, bad_request

# OpenAI's layout (", " and ": "), no free whitespace; defaults a schema's "x-guidance" can override
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_BYTES = 1 << 20


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise APIError(400, "structured outputs (response_format json_object / json_schema, forced tool "
                       "calls) need llguidance, which this server lacks (pip install 'exl3tools[serve]')",
                       param="response_format", code="unsupported_parameter") from None
    return llguidance


class Grammars:
    """The model's tokenizer in llguidance's form (built once, on the first structured request)."""

    def __init__(self, tokenizer_json: str, eos_token_ids: list[int], vocab_size: int) -> None:
        llg = _llguidance()
        self._llg = llg
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))

    def compile(self, response_format: Any) -> Grammar | None:
        """The request's response_format as a checked grammar; None for "text"."""
        kind = response_format.type
        if kind == "text":
            return None
        if kind == "json_object":
            schema: Any = {"type": "object"}
        else:                                   # json_schema (protocol.check_chat_extras let no other through)
            spec = response_format.json_schema
            schema = spec.schema_ if spec.schema_ is not None else {}
        return self.schema(schema, "response_format")

    def schema(self, schema: Any, param: str) -> Grammar:
        """A JSON schema as a checked grammar; ``param``: the request field a 400 names."""
        if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
            raise bad_request(f"{param}: the schema is over {MAX_SCHEMA_BYTES} bytes", param=param)
        LLMatcher = self._llg.LLMatcher
        try:
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise bad_request(f"{param}: {exc}", param=param) from None
        # built here, in the request's worker thread (up to ~1 s for a large schema), not on the
        # engine's thread: each choice copies it (Grammar.matcher)
        proto = LLMatcher(self.tokenizer, grammar, log_level=0)
        if proto.is_error():
            raise bad_request(f"{param}: the schema cannot be enforced: {proto.get_error().splitlines()[0]}",
                              param=param)
        return Grammar(proto)


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """A checked grammar (SamplingParams.grammar): every choice gets a matcher of its own."""

    proto: Any      # llguidance.LLMatcher at the grammar's start, never advanced

    def matcher(self) -> Matcher:
        return Matcher(self.proto.deep_copy())


class Matcher:
    """One choice's position in its grammar (runtime.sampling.Adjust's ``constraint``)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def allowed(self) -> bytes:
        """The tokens allowed next, a bit per token id (little-endian int32 words)."""
        return self._m.compute_bitmask()

    def consume(self, token: int) -> None:
        self._m.consume_token(int(token))
