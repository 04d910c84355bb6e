"""The OpenAI-compatible request protocol, re-exported from the modules that define it (for
callers outside the server: bench/, tests/):

- ``api_errors``: ``APIError`` and the OpenAI error shape;
- ``request_models``: the request types of completions and chat (strict; their rules in its
  docstring);
- ``request_body``: a body (bytes, or another API's dict) as a validated request, hostile input
  refused before anything is built from it;
- ``request_checks``: what the routes check and read in a validated request before tokenizing;
- ``sampling_params``: ``SamplingParams`` from a request's fields, and ``Prepared``.
"""

from exl3tools.server.api_errors import APIError, bad_request, error_body
from exl3tools.server.request_body import (
    MAX_BODY_BYTES,
    MAX_INT_DIGITS,
    MAX_JSON_CONTAINERS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    chat_request,
    parse_body,
)
from exl3tools.server.request_checks import (
    TEMPLATE_RESERVED,
    check_chat_extras,
    check_completion_extras,
    completion_prompts,
    join_text,
    message_dicts,
)
from exl3tools.server.request_models import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    NAME_FIELD,
    SEED_MAX,
    SEED_MIN,
    UNSUPPORTED_CHAT_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionSpec,
    JsonSchemaSpec,
    ResponseFormat,
    StreamOptions,
    StructuredOutputs,
    TextPart,
    ToolSpec,
    constraint_fields,
)
from exl3tools.server.sampling_params import MAX_STOP_LEN, Prepared, SamplingParams, sampling_params

__all__ = [
    "MAX_BODY_BYTES", "MAX_INT_DIGITS", "MAX_JSON_CONTAINERS", "MAX_LOGIT_BIAS", "MAX_MESSAGES", "MAX_N",
    "MAX_PROMPTS", "MAX_PROMPT_TOKENS", "MAX_STOP", "MAX_STOP_LEN", "MAX_STOP_TOKEN_IDS", "MAX_TOP_LOGPROBS",
    "NAME_FIELD", "SEED_MAX", "SEED_MIN", "TEMPLATE_RESERVED", "UNSUPPORTED_CHAT_FIELDS",
    "APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "FunctionSpec", "JsonSchemaSpec",
    "Prepared", "ResponseFormat", "SamplingParams", "StreamOptions", "StructuredOutputs", "TextPart", "ToolSpec",
    "bad_request", "chat_request", "check_chat_extras", "check_completion_extras", "completion_prompts",
    "constraint_fields", "error_body", "join_text", "message_dicts", "parse_body", "sampling_params",
]
