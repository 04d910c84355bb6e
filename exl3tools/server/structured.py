"""Structured outputs: a request's output constraint (``output_constraint``: response_format
json_object / json_schema, vLLM's structured_outputs json / regex / choice / grammar / json_object
and its older guided_* fields) and forced tool calls (server/tools.py) as a grammar that masks
every step's logits (llguidance, imported lazily).

The constraint is compiled and checked against the model's tokenizer when the request is prepared
(a schema, regex or grammar llguidance rejects is a 400 naming its field); each choice then gets its
own matcher (``Grammar.matcher``), which ``runtime.sampling.Adjust`` asks for the allowed tokens
before every draw and tells every token drawn. A regex must match the whole answer; choices are
llguidance's own (each string a Lark literal, so matched exactly); a grammar is Lark (regex
terminals, ``%json``) or GBNF, which llguidance converts. JSON comes out compact, as OpenAI's does
(", " and ": " between items, no other whitespace): with llguidance's default flexible whitespace a
model can emit blanks forever; a schema's ``x-guidance`` options override that. Once the grammar is
complete only EOS is allowed, so the choice ends with ``finish_reason`` "stop".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from exl3tools.server.api_errors import APIError, bad_request
from exl3tools.server.request_body import _unencodable
from exl3tools.server.request_models import ChatCompletionRequest, CompletionRequest

# OpenAI's layout (", " and ": "), no free whitespace; defaults a schema's "x-guidance" can override
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_BYTES = 1 << 20      # an output constraint's schema / regex / choices / grammar, as text


@dataclass(frozen=True, slots=True)
class Constraint:
    """The one rule a request's output follows (server/structured.py makes it a grammar)."""

    kind: Literal["json", "regex", "choice", "grammar"]
    value: Any      # a JSON schema (dict), a regex, the choices (list[str]), a Lark / GBNF grammar
    param: str      # the request field it came from, which a 400 names


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar")


def output_constraint(req: CompletionRequest | ChatCompletionRequest) -> Constraint | None:
    """The request's output constraint, checked (None: free text): response_format json_object /
    json_schema, structured_outputs' one field, or a guided_* field; more than one is a 400. 400s
    name response_format as the request's API does (``own_param``: text.format, output_config.format)."""
    found: list[tuple[str, Any, str]] = []         # (kind, value, param), unchecked
    fmt, name = req.response_format, req.own_param("response_format")   # text.format where Responses sent it
    if fmt is not None and fmt.type not in ("text", "json_object", "json_schema"):
        raise bad_request(f"{name} type {fmt.type!r} is not supported by this server "
                          "(text, json_object, json_schema are)", param=f"{name}.type",
                          code="unsupported_parameter")
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request(f"{name} json_schema needs its json_schema object", param=f"{name}.json_schema")
        schema = fmt.json_schema.schema_
        found.append(("json", {} if schema is None else schema, name))
    elif fmt is not None and fmt.type == "json_object":
        found.append(("json", {"type": "object"}, name))
    so = req.structured_outputs
    if so is not None:
        if so.json_object:
            found.append(("json", {"type": "object"}, "structured_outputs.json_object"))
        found += [(k, v, f"structured_outputs.{k}") for k in CONSTRAINT_KINDS
                  if (v := getattr(so, "json_" if k == "json" else k)) is not None]
    found += [(k, v, f"guided_{k}") for k in CONSTRAINT_KINDS if (v := getattr(req, f"guided_{k}")) is not None]
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(p for _, _, p in found)
        raise bad_request(f"at most one output constraint per request; got {names}", param=found[1][2])
    kind, value, param = found[0]
    if req.ignore_eos or req.min_tokens:
        # a finished grammar allows only EOS: neither may hold the answer open past it
        raise bad_request(f"{param} (an output constraint) cannot be combined with "
                          f"{'ignore_eos' if req.ignore_eos else 'min_tokens'}", param=param)
    if kind == "json" and isinstance(value, str):
        value = _schema_text(value, param)
    if kind == "choice" and not value:
        raise bad_request(f"{param} must hold at least one string", param=param)
    return Constraint(kind, value, param)


def _schema_text(text: str, param: str) -> dict[str, Any]:
    """A JSON schema sent as JSON text (vLLM takes both), parsed; 400s name ``param``."""
    _check_size(text, param, "the schema")   # before parsing: a body's container cap does not see inside
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):     # JSONDecodeError, an int past Python's digit limit, nesting
        raise bad_request(f"{param}: not a JSON schema (the text is not valid JSON)", param=param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema must be a JSON object", param=param)
    if _unencodable(json.dumps(schema, ensure_ascii=False)):
        raise bad_request(f"{param}: the schema holds a lone UTF-16 surrogate; send valid Unicode",
                          param=param, code="invalid_encoding")
    return schema


def _llguidance(param: str):
    try:
        import llguidance
    except ImportError:
        raise APIError(400, "structured outputs (response_format json_object / json_schema, structured_outputs, "
                       "guided_*, forced tool calls) need llguidance, which this server lacks (pip install "
                       "'exl3tools[serve]')", param=param, code="unsupported_parameter") from None
    return llguidance


class Grammars:
    """The model's tokenizer in llguidance's form (built once, on the first structured request)."""

    def __init__(self, tokenizer_json: str, eos_token_ids: list[int], vocab_size: int,
                 param: str = "response_format") -> None:
        """``param``: the field of the request that asked first, which a 400 without llguidance names."""
        llg = _llguidance(param)
        self._llg = llg
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))

    def compile(self, c: Constraint) -> Grammar:
        """A request's output constraint as a checked grammar."""
        if c.kind == "json":
            return self.schema(c.value, c.param)
        text = c.value if isinstance(c.value, str) else json.dumps(c.value)
        _check_size(text, c.param, "the " + c.kind)
        llg = self._llg
        try:
            if c.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(c.value)
            else:                                   # "choice" (a list of strings) or "grammar"
                grammar = llg.grammar_from(c.kind, c.value)
        except ValueError as exc:                   # a GBNF grammar its converter cannot read
            raise bad_request(f"{c.param}: {exc}", param=c.param) from None
        return self._checked(grammar, c.param, f"the {c.kind}")

    def schema(self, schema: Any, param: str) -> Grammar:
        """A JSON schema as a checked grammar; ``param``: the request field a 400 names."""
        _check_size(json.dumps(schema), param, "the schema")
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise bad_request(f"{param}: {exc}", param=param) from None
        return self._checked(grammar, param, "the schema")

    def _checked(self, grammar: str, param: str, what: str) -> Grammar:
        # built here, in the request's worker thread (up to ~1 s for a large schema), not on the
        # engine's thread: each choice copies it (Grammar.matcher)
        proto = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if proto.is_error():
            raise bad_request(f"{param}: {what} cannot be enforced: {_first_error(proto.get_error())}",
                              param=param)
        return Grammar(proto)


def _check_size(text: str, param: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_BYTES:
        raise bad_request(f"{param}: {what} is over {MAX_GRAMMAR_BYTES} bytes", param=param)


def _first_error(text: str) -> str:
    """llguidance's error's first line, and the regex parser's "error: ..." line where it has one."""
    lines = text.splitlines() or [""]
    detail = next((x.strip().removeprefix("error:") for x in lines[1:] if x.strip().startswith("error:")), "")
    return f"{lines[0]} {detail.strip()}".strip()


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
