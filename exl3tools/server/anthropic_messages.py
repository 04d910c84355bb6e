"""Anthropic's Messages API (POST /v1/messages, and /v1/messages/count_tokens) over the chat
engine, for clients that speak it (Claude Code and other agents pointed at a local GLM or
DeepSeek). A request becomes the chat completion it amounts to (``system`` the system message;
text, ``tool_use`` and ``tool_result`` blocks the messages, an assistant turn's calls and the tool
messages; ``tools`` with their ``input_schema`` and ``tool_choice`` in chat's shape;
``stop_sequences`` the stop strings; ``output_config.format`` the response_format; vLLM's
``structured_outputs`` and ``guided_*`` as they are), so it takes the same template, grammar,
tool-call and reasoning paths; the chat answer becomes a message (thinking, text and tool_use
blocks), streamed as Anthropic's events. Errors answer in Anthropic's shape."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import Field

from exl3tools.server.api_errors import APIError, bad_request
from exl3tools.server.reasoning import template_switch
from exl3tools.server.request_body import chat_request
from exl3tools.server.request_checks import join_text
from exl3tools.server.request_models import ChatCompletionRequest, _Constrained, constraint_fields


class MessagesChat(ChatCompletionRequest):
    """The chat request a Messages request becomes (``to_chat``): its 400s name the Messages fields
    (output_config.format, tools[i].name, tools[i].input_schema)."""

    param_names = ((r"^tools\.(\d+)\.function\.parameters\b", r"tools[\1].input_schema"),
                   (r"^tools\.(\d+)\.function\.", r"tools[\1]."),
                   (r"^response_format\.json_schema\.schema\b", "output_config.format.schema"),
                   (r"^response_format\b.*", "output_config.format"))


class MessagesRequest(_Constrained):     # vLLM's structured_outputs / guided_* too (Anthropic has none)
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None   # its ``format`` (a JSON schema) holds the answer
    thinking: Any = None      # extended thinking on or off: the template's switch (server/reasoning.py)
    # accepted and ignored: prompt caching is the server's own (prefix caching); the rest is
    # Anthropic's platform
    metadata: Any = None
    service_tier: Any = None
    container: Any = None
    cache_control: Any = None
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None
    # refused unless null (400): features this server lacks
    mcp_servers: Any = None


class CountTokensRequest(_Constrained):   # the Messages body's fields: a client may send one to both
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    thinking: Any = None
    cache_control: Any = None
    context_management: Any = None


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: APIError) -> dict[str, Any]:
    """An APIError in Anthropic's shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


def to_chat(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request that ``req`` amounts to (400s name the Messages field)."""
    if getattr(req, "mcp_servers", None) is not None:
        raise bad_request("mcp_servers is not supported by this server", param="mcp_servers",
                          code="unsupported_parameter")
    msgs: list[dict[str, Any]] = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad_request(f"messages[{i}].role must be user or assistant", param=f"messages[{i}].role")
        if isinstance(content, str):
            msgs.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"messages[{i}].content must be a string or a list of blocks",
                              param=f"messages[{i}].content")
        texts, calls = [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str):
                    raise bad_request(f"{where}.name: a tool_use block needs the tool's name", param=f"{where}.name")
                calls.append({"id": b.get("id"), "type": "function", "function": {
                    "name": b.get("name"), "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":      # before the turn's own text, in order
                msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                             "content": _text(b.get("content"), where)})
            elif kind not in ("thinking", "redacted_thinking"):  # earlier thinking is not fed back
                raise bad_request(f"{where}.type {kind!r} is not supported (text, tool_use, tool_result, "
                                  "thinking are)", param=f"{where}.type", code="unsupported_parameter")
        if texts or calls or not content:
            msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    body: dict[str, Any] = {"model": req.model, "messages": msgs}
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if getattr(req, key, None) is not None:
            body[key] = getattr(req, key)
    if getattr(req, "stop_sequences", None):
        body["stop"] = req.stop_sequences
    if req.tools is not None:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    choice = req.tool_choice
    if choice is not None and (req.tools or choice.get("type") == "none"):
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise bad_request(f"tool_choice.type {kind!r} is not one of auto, any, tool, none", param="tool_choice.type")
        if kind == "tool" and not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name: a tool_choice of type tool needs the tool's name",
                              param="tool_choice.name")
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}} if kind == "tool"
                               else "required" if kind == "any" else kind)
    if req.thinking is not None:     # extended thinking on or off: the template's switch
        kind = req.thinking.get("type") if isinstance(req.thinking, dict) else None
        if kind not in ("enabled", "adaptive", "disabled"):
            raise bad_request("thinking.type must be enabled, adaptive or disabled", param="thinking.type")
        body["chat_template_kwargs"] = template_switch(kind != "disabled")
    fmt = (req.output_config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise bad_request("output_config.format.type must be json_schema", param="output_config.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}
    body.update(constraint_fields(req))     # checked with output_config.format by structured.output_constraint
    return chat_request(body, MessagesChat)


def _text(content: Any, where: str) -> str:
    return join_text(content, ("text",), where)


def _tool(t: dict[str, Any], i: int) -> dict[str, Any]:
    if "input_schema" not in t or t.get("type") not in (None, "custom"):
        raise bad_request(f"tools[{i}]: only client tools (name, input_schema) are supported",
                          param=f"tools[{i}]", code="unsupported_parameter")
    fn = {"name": t.get("name"), "parameters": t["input_schema"]}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def new_id(prefix: str = "msg") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": chat_usage["completion_tokens"]}


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}


def from_chat(chat: dict[str, Any], mid: str) -> dict[str, Any]:
    """A whole chat completion (one choice) as the message."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": _input(c["function"]["arguments"])}
                for c in msg.get("tool_calls") or []]
    reason, matched = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    return {"id": mid, "type": "message", "role": "assistant", "model": chat["model"], "content": content,
            "stop_reason": reason, "stop_sequence": matched, "usage": usage(chat["usage"])}


def stop_reason(finish: str | None, stopped_by: str | int | None) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a chat finish and what stopped it."""
    if finish == "stop" and isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return STOP_REASONS.get(finish, "end_turn"), None


class EventWriter:
    """Chat stream chunks in, Anthropic stream events out: thinking, then text, then tool_use
    blocks, each opened, filled by deltas and stopped in order."""

    def __init__(self, mid: str, model: str, input_tokens: int) -> None:
        self.mid, self.model, self.input_tokens = mid, model, input_tokens
        self.index = -1
        self.open: str | None = None
        self.finish: str | None = None
        self.stopped_by: str | int | None = None

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                out += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                out += self._open("tool_use", {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": {}})
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": fn.get("arguments") or "{}"}})
            if choice.get("finish_reason"):
                self.finish, self.stopped_by = choice["finish_reason"], choice.get("stop_reason")
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.index += 1
        self.open = kind
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if self.open != kind:
            out = self._open(kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                             else {"type": "text", "text": ""})
        return out + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":      # the block's signature (none: nothing here signs its thinking)
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "signature_delta", "signature": ""}})
        self.open = None
        return out + [{"type": "content_block_stop", "index": self.index}]

    def error(self, err: APIError) -> dict[str, Any]:
        return error_body(err)

    def end(self, chat_usage: dict[str, Any]) -> list[dict[str, Any]]:
        reason, matched = stop_reason(self.finish, self.stopped_by)
        return self._close() + [
            # the whole usage (Anthropic's counts here are cumulative): message_start went out before
            # admission, when the prefix cache's hits were unknown, so the SDK's final message
            # kept input_tokens = the whole prompt where the unstreamed answer gives prompt - hits
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": matched},
             "usage": usage(chat_usage)},
            {"type": "message_stop"}]
