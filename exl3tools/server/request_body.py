"""A request body as a validated request: ``parse_body`` (the bytes a route received) and
``chat_request`` (the chat request another API's body becomes). Hostile input is refused before
the parser or pydantic builds anything from it (sizes, container and list counts, over-long integer
literals, lone surrogates); pydantic's errors become the OpenAI 400 naming the parameter.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from exl3tools.checkpoint import jsonio
from exl3tools.server.api_errors import APIError, bad_request
from exl3tools.server.request_models import ChatCompletionRequest

# prompts per completions request: lm-eval's batched scoring sends batch_size prompts in one (vLLM
# has no cap); the engine still refuses prompts x n past --max-queue (too_many_sequences)
MAX_PROMPTS = 1024
MAX_STOP = 16
MAX_PROMPT_TOKENS = 1 << 20      # token ids in one prompt (any model's context is shorter)
MAX_MESSAGES = 16384             # chat messages per request
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300             # entries (OpenAI's limit)
MAX_BODY_BYTES = 16 * 1024 * 1024
# JSON arrays + objects in one body, counted before parsing: 16 MB of "[]," is 5.6M empty lists that
# took 5 s and ~300 MB to parse before any cap could look at them. Legitimate bodies stay far below
# (16384 messages with multi-part content are ~65k).
MAX_JSON_CONTAINERS = 1 << 17
# Integer literals longer than this are refused before int() sees them: no field takes more than
# 20 digits, and Python's int() raises ValueError (an HTTP 500) beyond 4300.
MAX_INT_DIGITS = 100


def parse_body(raw: bytes, model_cls: type[BaseModel]) -> Any:
    """Bytes -> validated request, or an APIError(400) naming the offending parameter."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    _refuse_container_bombs(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})",
                          code="invalid_encoding") from None
    long_ints: list[_LongInt] = []
    # the per-literal hook only where a run of digits could be a long integer: on a 2048-token id
    # prompt it was 1.3 ms of Python a request (json.loads alone 0.2), the GIL held while a burst parses
    hook = (lambda s: _parse_int(s, long_ints)) if _LONG_RUN in raw.translate(_DIGITS_AS_ZEROS) else None
    try:
        obj = json.loads(text, parse_int=hook)
    except (json.JSONDecodeError, RecursionError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise bad_request(f"request body is not valid JSON: {msg}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    if long_ints or _SURROGATE_ESCAPE.search(text):
        _refuse_unencodable(obj)
    _refuse_oversized_lists(obj)
    try:
        return model_cls.model_validate(obj)
    except ValidationError as exc:
        raise _from_validation(exc) from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None


def chat_request(body: dict[str, Any],
                 model_cls: type[ChatCompletionRequest] = ChatCompletionRequest) -> ChatCompletionRequest:
    """A chat request built from another API's (server/openai_responses.py, anthropic_messages.py,
    tokenization.py); ``model_cls``: that API's subclass, whose ``own_param`` names its fields
    in the 400s."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise _from_validation(exc, model_cls.own_param) from None


def _refuse_container_bombs(raw: bytes) -> None:
    """At most MAX_JSON_CONTAINERS arrays and objects, counted before the parser builds them (in C,
    then, past the cap, by jsonio's vectorised scan: brackets inside strings, code in a prompt, do
    not count)."""
    n = jsonio.shape_past(raw, MAX_JSON_CONTAINERS)[1]
    if n > MAX_JSON_CONTAINERS:
        raise APIError(413, f"request body holds {n} JSON arrays and objects; at most {MAX_JSON_CONTAINERS}",
                       code="request_too_large")


def _refuse_oversized_lists(obj: dict) -> None:
    """Count caps checked on the parsed JSON, before validation builds a model object per element
    (a 7 MB body of 2M one-token prompts took 4 s and ~1 GB of memory to refuse afterwards)."""
    def too_long(name: str, cap: int, what: str) -> None:
        v = obj.get(name)
        if isinstance(v, (list, dict)) and len(v) > cap:
            raise bad_request(f"{name}: at most {cap} {what}", param=name)

    p = obj.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (list, str)):
        too_long("prompt", MAX_PROMPTS, "prompts per request")
    too_long("prompt", MAX_PROMPT_TOKENS, "prompt tokens")
    too_long("messages", MAX_MESSAGES, "messages")
    too_long("stop", MAX_STOP, "stop sequences")
    too_long("stop_token_ids", MAX_STOP_TOKEN_IDS, "stop token ids")
    too_long("logit_bias", MAX_LOGIT_BIAS, "entries")


class _LongInt:
    """An integer literal of more than MAX_INT_DIGITS digits, kept as text until it is refused."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(s: str, seen: list[_LongInt]) -> int | _LongInt:
    if len(s.lstrip("-")) <= MAX_INT_DIGITS:
        return int(s)
    seen.append(_LongInt(len(s.lstrip("-"))))
    return seen[-1]


# parse_body: a run of more than MAX_INT_DIGITS digits anywhere (in C: 14 us on a 2048-id body, a
# regex took 320), the only place a literal _parse_int refuses can be
_DIGITS_AS_ZEROS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)

# JSON's only way to a lone surrogate: a \uD800-\uDFFF escape (a valid pair decodes to one code
# point). Such a string cannot be encoded as UTF-8: not by the tokenizer, not in our error body.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _unencodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _printable(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _refuse_unencodable(obj: Any) -> None:
    """400 naming the first value (in document order) that is a lone surrogate (in a string or a
    key) or an over-long integer; nothing otherwise."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(obj, ())]
    while stack:
        v, path = stack.pop()
        param = ".".join(path) or None
        if isinstance(v, _LongInt):
            raise bad_request(f"{param}: integer literal of {v.digits} digits (at most {MAX_INT_DIGITS})",
                              param=param)
        if isinstance(v, str) and _unencodable(v):
            raise bad_request(f"{param}: string holds a lone UTF-16 surrogate (\\ud800-\\udfff); "
                              "send valid Unicode", param=param, code="invalid_encoding")
        if isinstance(v, dict):
            items = []
            for k, x in v.items():
                key = _printable(k)
                if _unencodable(k):
                    p = ".".join((*path, key))
                    raise bad_request(f"{p}: key holds a lone UTF-16 surrogate; send valid Unicode",
                                      param=p, code="invalid_encoding")
                items.append((x, (*path, key)))
            stack.extend(reversed(items))
        elif isinstance(v, list):
            stack.extend(reversed([(x, (*path, str(i))) for i, x in enumerate(v)]))


def _from_validation(exc: ValidationError, own_param: Any = None) -> APIError:
    """The 400 of pydantic's first error; ``own_param``: the field's name in the API the request
    came from (``_Sampling.own_param``), where another API's body became a chat request."""
    errs = exc.errors(include_url=False, include_input=False)
    # A union reports one error per branch; the first is representative enough.
    err = errs[0]
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and p.endswith("]"))]
    param = ".".join(_clean_loc(loc)) or None
    if param and own_param is not None:
        param = own_param(param)
    kind = err["type"]
    code = ("missing_required_parameter" if kind == "missing"
            else "unknown_parameter" if kind == "extra_forbidden"
            else "unsupported_parameter" if kind == "unsupported_parameter"
            else "invalid_type" if kind.endswith("_type") or kind in ("union_tag_invalid",)
            else "invalid_value")
    text = "unknown parameter (not an OpenAI field nor a documented extension)" \
        if kind == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    msg = f"{param}: {text}" if param else text
    return bad_request(msg, param=param, code=code)


def _clean_loc(loc: list[str]) -> list[str]:
    # pydantic puts union branch names ("list[int]") into loc; drop them.
    return [p for p in loc if "[" not in p and p not in ("str", "int", "float", "bool")]
