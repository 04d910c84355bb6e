"""What the routes check and read in a validated request before tokenizing: field combinations the
request types cannot express (``check_completion_extras``, ``check_chat_extras``), and the prompts
and messages in the shapes the tokenizer and the chat template take."""

from __future__ import annotations

import json
from typing import Any

from exl3tools.server.api_errors import bad_request
from exl3tools.server.request_models import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest, CompletionRequest

# Keys the server itself passes to the chat template: chat_template_kwargs may not set them.
TEMPLATE_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token")


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
