"""OpenAI request types, their validation, and the OpenAI error shape.

Pydantic runs in strict mode: ``"max_tokens": "5"`` or ``true`` is a 400, as with OpenAI.
Unknown top-level fields are a 400 naming them, as OpenAI answers "Unrecognized request argument":
a typo such as ``max_token`` must not pass silently. Accepted are OpenAI's own request fields (as
the official client sends them) and the documented extensions (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, min_tokens, return_token_ids; chat: chat_template_kwargs,
add_generation_prompt); presence/frequency/repetition penalties, logit_bias, min_p, min_tokens
and output constraints are applied (runtime/sampling.py ``Adjust``). An output constraint is a
grammar mask (server/structured.py), on chat and, as vLLM, on plain completions: response_format
json_object / json_schema; vLLM's ``structured_outputs`` with one of ``json`` (a schema, or its
JSON text), ``regex``, ``choice`` (the answer is exactly one of the strings), ``grammar`` (Lark or
GBNF, as llguidance reads it) or ``json_object: true``; or vLLM's older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one per request (two are a 400
naming them; server/structured.py ``output_constraint``); chat's tools with a forced tool_choice are a grammar too
(server/tools.py). Every feature we do not implement is rejected
explicitly when set to a non-default value; OpenAI fields that change nothing here (metadata,
caching hints) are accepted and ignored. Nested objects (messages, stream_options) stay lenient.
JSON null on any optional field means its default, as OpenAI's nullable fields and vLLM read it
(``"n": null`` is n = 1); a required field's null stays a 400. A message's content parts other than
text (image_url, input_audio, file) are a 400 unsupported_parameter naming the part's type.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from exl3tools.checkpoint import jsonio
from exl3tools.server.limits import sampling_value_problem

MAX_N = 16  # choices per prompt
# prompts per completions request: lm-eval's batched scoring sends batch_size prompts in one (vLLM
# has no cap); the engine still refuses prompts x n past --max-queue (too_many_sequences)
MAX_PROMPTS = 1024
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_TOP_LOGPROBS = 20
MAX_PROMPT_TOKENS = 1 << 20      # token ids in one prompt (any model's context is shorter)
MAX_MESSAGES = 16384             # chat messages per request
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300             # entries (OpenAI's limit)
MAX_BODY_BYTES = 16 * 1024 * 1024
# JSON arrays + objects in one body, counted before parsing: 16 MB of "[]," is 5.6M empty lists that
# took 5 s and ~300 MB to parse before any cap could look at them. Legitimate bodies stay far below
# (16384 messages with multi-part content are ~65k).
MAX_JSON_CONTAINERS = 1 << 17
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Integer literals longer than this are refused before int() sees them: no field takes more than
# 20 digits, and Python's int() raises ValueError (an HTTP 500) beyond 4300.
MAX_INT_DIGITS = 100
# Keys the server itself passes to the chat template: chat_template_kwargs may not set them.
TEMPLATE_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token")


class APIError(Exception):
    """An error answered in the OpenAI shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# --------------------------------------------------------------------------- request types


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _NullIsDefault(_Strict):
    """null on a field that has a default means that default, so downstream code sees plain types
    (OpenAI's spec and vLLM take ``"n": null``, ``"stream": null`` as omitted); a required field's
    null, an unknown field's too, still fails validation."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None for v in data.values()):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].is_required()}
        return data


class StreamOptions(_NullIsDefault):
    include_usage: bool = False


class _Request(_NullIsDefault):
    model_config = ConfigDict(strict=True, extra="forbid")  # the top level: unknown fields are a 400


class StructuredOutputs(_NullIsDefault):
    """vLLM's ``structured_outputs``: one of these (structured.output_constraint); unknown keys are a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")    # a pydantic name clash
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Constrained(_Request):
    """vLLM's output constraints besides response_format (structured.output_constraint): fields of
    chat and completions, and of the Responses and Messages APIs, which hand them on to chat."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def constraint_fields(req: _Constrained) -> dict[str, Any]:
    """``req``'s vLLM constraint fields that are set, for the chat request another API becomes."""
    return {k: v for k in _Constrained.model_fields if (v := getattr(req, k)) is not None}


class _Sampling(_Constrained):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False
    return_token_ids: bool = False  # extension (as vLLM): choices carry token_ids
    user: str | None = None
    # logits processing before sampling (runtime/sampling.py Adjust; OpenAI / vLLM semantics)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    # the field a 400 names for response_format: the Responses / Messages API's own (chat_request)
    _format_param: str = PrivateAttr(default="response_format")

    @field_validator("temperature", "top_p")
    @classmethod
    def _float32_sampler(cls, v: float | None, info: Any) -> float | None:
        upper = 2.0 if info.field_name == "temperature" else 1.0
        problem = sampling_value_problem(info.field_name, v, upper=upper,
                                         zero_ok=info.field_name == "temperature")
        if problem:
            raise ValueError(problem)
        return v


# OpenAI's rule for a json_schema's and a function's name
NAME_FIELD = dict(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")


class JsonSchemaSpec(_Strict):
    """response_format.json_schema (OpenAI): the schema under "schema" (a pydantic name clash)."""

    name: str = Field(**NAME_FIELD)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: str
    json_schema: JsonSchemaSpec | None = None


class CompletionRequest(_Sampling):
    # list[int] before list[str]: a strict union tries its members in order, and list[str] first
    # failed on every id of a token prompt (2048 errors: 0.67 ms a request, 0.04 this way); the
    # members are disjoint under strict, so what matches and the first error are the same
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)    # 0: with echo, the prompt alone (scoring)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False    # the prompt before the completion; with logprobs, its tokens' logprobs too
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None    # vLLM's extension: the completion's grammar


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        # an image / audio / file part is a feature we lack (unsupported_parameter), not a type error
        if isinstance(v, list):
            for p in v:
                kind = p.get("type") if isinstance(p, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError("unsupported_parameter",
                                              "content part type '{kind}' is not supported (only text is)",
                                              {"kind": kind})
        return v


class FunctionSpec(_Strict):
    name: str = Field(**NAME_FIELD)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    """One of chat's ``tools`` (server/tools.py)."""

    type: str
    function: FunctionSpec


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: Any = None       # "none" | "auto" | "required" | {"type": "function", ...}: server/tools.py
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    modalities: list[str] | None = None
    # thinking on ("low" and up) or off ("none", "minimal") through the template (server/reasoning.py)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # OpenAI fields that change nothing here: accepted, ignored.
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    parallel_tool_calls: Any = None  # ignored: a forced call is one call, an auto answer's all (server/tools.py)
    # OpenAI features this server lacks: a 400 unsupported_parameter unless null.
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    moderation: Any = None
    prediction: Any = None
    verbosity: Any = None
    web_search_options: Any = None


UNSUPPORTED_CHAT_FIELDS = ("audio", "function_call", "functions", "moderation", "prediction",
                           "verbosity", "web_search_options")


# --------------------------------------------------------------------------- sampling values


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the engine needs for one choice; validated, normalised, immutable."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: off; k: chosen token + k alternatives
    # completions' echo with logprobs: each prompt token's logprob and k alternatives (None: off)
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    grammar: Any = None  # response_format's checked grammar: has matcher() (server/structured.py)
    # a reasoning model's thinking before the grammar (server/reasoning.think_gate): (the <think>
    # token, the </think> token, whether the prompt opened it); the grammar holds what follows
    think_gate: tuple[int, int, bool] | None = None

    @property
    def token_by_token(self) -> bool:
        """Logprobs or processed logits: each token is read on the host before the next step
        (the engine neither chains nor drafts such a row)."""
        return self.logprobs is not None or self.adjusts_logits

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are processed before sampling (runtime.sampling.Adjust)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or (self.min_p and self.temperature > 0)
                    or self.grammar is not None)


@dataclass(slots=True)
class Prepared:
    """A validated request, tokenised: prompts x n choices."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


def parse_body(raw: bytes, model_cls: type[_Strict]) -> Any:
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


def _from_validation(exc: ValidationError) -> APIError:
    errs = exc.errors(include_url=False, include_input=False)
    # A union reports one error per branch; the first is representative enough.
    err = errs[0]
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and p.endswith("]"))]
    param = ".".join(_clean_loc(loc)) or None
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


def _logit_bias(req: _Sampling, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}."""
    bias = req.logit_bias or {}      # its entry count: parse_body's _refuse_oversized_lists
    out = []
    for key, value in bias.items():
        if not key.isdigit() or len(key) > 12 or not 0 <= int(key) < vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key[:40]!r}",
                              param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _stops(req: _Sampling, vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])   # counts: parse_body
    for s in stop:
        if not s or len(s) > MAX_STOP_LEN:
            raise bad_request(f"stop sequences must have 1 to {MAX_STOP_LEN} characters", param="stop")
    ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < vocab_size for t in ids):
        raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size})",
                          param="stop_token_ids")
    return tuple(stop), tuple(ids)


def sampling_params(req: _Sampling, *, max_tokens: int, logprobs: int | None,
                    vocab_size: int, defaults: dict | None = None) -> SamplingParams:
    """``defaults`` (the model's generation_config.json: temperature, top_p, top_k,
    repetition_penalty, min_p) fill the fields the request leaves out; then OpenAI's 1 / 1 / off
    and no penalty, no min_p."""
    stop, stop_ids = _stops(req, vocab_size)
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
    d = defaults or {}
    top_k = d.get("top_k", 0) if req.top_k is None else req.top_k
    top_k = top_k if top_k > 0 else 0
    temperature = d.get("temperature", 1.0) if req.temperature is None else req.temperature
    top_p = d.get("top_p", 1.0) if req.top_p is None else req.top_p
    repetition_penalty = d.get("repetition_penalty", 1.0) if req.repetition_penalty is None else req.repetition_penalty
    min_p = d.get("min_p", 0.0) if req.min_p is None else req.min_p
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=req.seed, stop=stop, stop_token_ids=stop_ids, logprobs=logprobs,
                          ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty or 0.0,
                          frequency_penalty=req.frequency_penalty or 0.0,
                          repetition_penalty=repetition_penalty, logit_bias=_logit_bias(req, vocab_size), min_p=min_p,
                          min_tokens=req.min_tokens or 0)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompt field in its four OpenAI forms, as a list of str or token lists."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)                   # at most MAX_PROMPTS: parse_body's _refuse_oversized_lists


def check_completion_extras(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt's logprobs)",
                          param="max_tokens")
    if req.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix",
                          code="unsupported_parameter")
    if req.best_of not in (None, req.n):
        raise bad_request("best_of must equal n (beam search is not supported)", param="best_of",
                          code="unsupported_parameter")


def check_chat_extras(req: ChatCompletionRequest) -> None:
    for name in UNSUPPORTED_CHAT_FIELDS:
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported by this server", param=name,
                              code="unsupported_parameter")
    if req.modalities not in (None, ["text"]):
        raise bad_request("modalities other than [\"text\"] are not supported by this server",
                          param="modalities", code="unsupported_parameter")
    for key in TEMPLATE_RESERVED:
        if key in (req.chat_template_kwargs or {}):
            where = "the request's own field" if key == "add_generation_prompt" else "set by the server"
            raise bad_request(f"chat_template_kwargs.{key} is {where}; it cannot be a template kwarg",
                              param=f"chat_template_kwargs.{key}")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    if (req.max_tokens is not None and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens):
        raise bad_request("max_tokens and max_completion_tokens disagree", param="max_tokens")


def chat_request(body: dict[str, Any], format_param: str = "response_format") -> ChatCompletionRequest:
    """A chat request built from another API's (server/openai_responses.py, anthropic_messages.py);
    ``format_param``: that API's name for what became ``response_format``, which its 400s name."""
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _from_validation(exc) from None
    req._format_param = format_param
    return req


def join_text(content: Any, kinds: tuple[str, ...], where: str) -> str:
    """A string, or a list of text parts or blocks (each a dict of a type in ``kinds``), as one
    string; a 400 naming ``where`` for any other part (images and the like)."""
    if isinstance(content, str) or content is None:
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise bad_request(f"{where}: only text is supported", param=where, code="unsupported_parameter")


def message_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template (text parts joined)."""
    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        for key in ("tool_calls", "tool_call_id"):     # a call and its result, for the template
            value = (m.model_extra or {}).get(key)
            if value is not None:
                d[key] = _template_tool_calls(value) if key == "tool_calls" else value
        out.append(d)
    return out


def _template_tool_calls(calls: Any) -> Any:
    """An assistant message's tool_calls as templates read them: each call's ``arguments`` a
    mapping where the client sent OpenAI's JSON string (templates iterate over them)."""
    if not isinstance(calls, list):
        raise bad_request("messages[].tool_calls must be a list", param="messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("messages[].tool_calls[] needs function.name", param="messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except ValueError:
                raise bad_request("messages[].tool_calls[].function.arguments is not JSON", param="messages") from None
        out.append({**c, "function": {**fn, "arguments": args}})
    return out
