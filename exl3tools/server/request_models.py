"""The request types of /v1/completions and /v1/chat/completions (and the strict bases and
constraint fields the Responses, Messages and tokenize APIs build on).

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

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from exl3tools.server.limits import sampling_value_problem

MAX_N = 16  # choices per prompt
MAX_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


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
    # the names 400s give fields: a chat request another API becomes names that API's own (a
    # subclass sets them: openai_responses.ResponsesChat, anthropic_messages.MessagesChat), as
    # (regex, replacement) pairs for a chat field's path, the first that matches applied
    # (response_format -> text.format, tools.0.function.name -> tools[0].name); ``own_param``.
    # A ClassVar, so no request body can set it
    param_names: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def own_param(cls, param: str) -> str:
        """``param`` (a chat field's path, as a 400 names it) as this request's API names it."""
        for pattern, name in cls.param_names:
            renamed, n = re.subn(pattern, name, param)
            if n:
                return renamed
        return param

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

