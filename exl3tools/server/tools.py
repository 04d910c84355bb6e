"""Forced tool calls: chat's ``tools`` with ``tool_choice`` "required" or a named function.

The answer is held to one call by a grammar (server/structured.py): a JSON object
``{"name": <a tool's name>, "arguments": <that tool's parameters schema>}``, whatever the model's
own tool-call syntax, and comes back as OpenAI's ``message.tool_calls`` (one call, its
``arguments`` a JSON string) with ``finish_reason`` "tool_calls". The tools also reach the chat
template (``tools``), which renders them where the model expects them. ``tool_choice`` "auto"
(OpenAI's default when tools are given) would need a parser of each model family's own call
syntax to tell a call from text: refused with a 400 that says to force the call; "none" renders
the tools and generates text.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from exl3tools.server.protocol import ChatCompletionRequest, bad_request

MAX_TOOLS = 128


def forced_functions(req: ChatCompletionRequest) -> list[Any] | None:
    """The functions one of which the answer must call (tool_choice "required": every tool; a
    named one: that one), None when no call is forced. 400s for what cannot be served."""
    tools, choice = req.tools, req.tool_choice
    if tools is not None:
        if len(tools) > MAX_TOOLS:
            raise bad_request(f"at most {MAX_TOOLS} tools", param="tools")
        for i, t in enumerate(tools):
            if t.type != "function":
                raise bad_request(f"tools[{i}].type {t.type!r} is not supported (function is)",
                                  param=f"tools[{i}].type", code="unsupported_parameter")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise bad_request("tool function names must be unique", param="tools")
    if choice is None or choice == "none":
        if tools and choice is None:
            raise _auto_refused()
        return None
    if choice == "auto":
        if tools:
            raise _auto_refused()
        return None
    if not tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    if choice == "required":
        return [t.function for t in tools]
    name = _named(choice)
    for t in tools:
        if t.function.name == name:
            return [t.function]
    raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")


def _auto_refused():
    return bad_request("tool_choice \"auto\" (the default with tools) is not supported by this server: it "
                       "cannot tell a model's own tool-call syntax from text; send tool_choice \"required\" "
                       "or {\"type\": \"function\", \"function\": {\"name\": ...}} to force a call, or "
                       "\"none\"", param="tool_choice", code="unsupported_parameter")


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    return name


def call_schema(functions: list[Any]) -> dict:
    """The JSON schema of one call of one of ``functions``: {"name": const, "arguments": its
    parameters} (no parameters: an empty object)."""
    def one(fn: Any) -> dict:
        params = fn.parameters if fn.parameters is not None else {
            "type": "object", "properties": {}, "additionalProperties": False}
        return {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}
    calls = [one(fn) for fn in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_calls(text: str) -> list[dict] | None:
    """The generated call as OpenAI's ``tool_calls`` (one entry), None when ``text`` is not a
    complete call (``max_tokens`` ran out first)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": obj["name"],
                          "arguments": json.dumps(obj["arguments"], ensure_ascii=False, separators=(", ", ": "))}}]


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as the chat template gets them (OpenAI's shape, unset fields left out)."""
    if not req.tools:
        return None
    return [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
