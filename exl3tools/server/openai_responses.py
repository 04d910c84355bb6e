"""OpenAI's Responses API (POST /v1/responses) over the chat engine. A request becomes a chat
completion request (``instructions`` the system message, ``input`` items the messages, function
tools and tool_choice in chat's shape, ``text.format`` the response_format, vLLM's
``structured_outputs`` and ``guided_*`` as they are), so it takes the same template, grammar,
tool-call and reasoning paths; the chat answer becomes a Response (reasoning, message and
function_call output items), streamed as Responses events. Stateless: nothing is stored, so
``previous_response_id`` is a 400."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import Field

from exl3tools.server.api_errors import bad_request
from exl3tools.server.reasoning import EFFORTS
from exl3tools.server.request_body import chat_request
from exl3tools.server.request_checks import join_text
from exl3tools.server.request_models import ChatCompletionRequest, _Constrained, constraint_fields


class ResponsesChat(ChatCompletionRequest):
    """The chat request a Responses request becomes (``to_chat``): its 400s name the Responses
    fields (text.format, input, tools[i].name, max_output_tokens)."""

    param_names = ((r"^messages\b.*", "input"), (r"^tools\.(\d+)\.function\.", r"tools[\1]."),
                   (r"^response_format\.json_schema\b", "text.format"), (r"^response_format\b", "text.format"),
                   (r"^max_(completion_)?tokens$", "max_output_tokens"))


class ResponsesRequest(_Constrained):     # vLLM's structured_outputs / guided_* too, as on chat
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None
    # accepted and ignored: nothing is stored (``reasoning``'s effort switches the thinking)
    store: Any = None
    metadata: Any = None
    user: Any = None
    parallel_tool_calls: Any = None
    truncation: Any = None
    include: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    reasoning: Any = None
    # refused unless null (400 unsupported_parameter): they need state or features this server lacks
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None


UNSUPPORTED = ("previous_response_id", "conversation", "background", "prompt", "top_logprobs", "max_tool_calls")
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")      # a message item's (tool output: function_call_output)


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that ``req`` amounts to (400s name the Responses field)."""
    for name in UNSUPPORTED:
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported by this server (it stores no responses)"
                              if name in ("previous_response_id", "conversation") else
                              f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, it in enumerate(items):
        kind = it.get("type", "message")
        if kind == "message":
            if it.get("role") not in ROLES:
                raise bad_request(f"input[{i}].role must be one of {', '.join(ROLES)}", param=f"input[{i}].role")
            msgs.append({"role": it.get("role"), "content": _text(it.get("content"), i)})
        elif kind == "function_call":
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": _call_name(it, i), "arguments": _arguments(it, i)}}
            last = msgs[-1] if msgs else {}
            if last.get("role") == "assistant" and "tool_calls" in last:    # calls of one turn together
                last["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"),
                         "content": out if isinstance(out, str) else _text(out, i)})
        elif kind != "reasoning":          # earlier thinking is not fed back, as chat templates drop it
            raise bad_request(f"input[{i}].type {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning are)", param=f"input[{i}].type",
                              code="unsupported_parameter")
    if not msgs:
        raise bad_request("input holds nothing to answer (no message, function call or output) and there "
                          "are no instructions", param="input")
    body: dict[str, Any] = {"model": req.model, "messages": msgs, "stream": req.stream}
    for src, dst in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    if req.tools is not None:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        c = req.tool_choice
        name = c.get("name") if isinstance(c, dict) and c.get("type") == "function" else None
        if c not in ("none", "auto", "required") and not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                              param="tool_choice")
        body["tool_choice"] = c if name is None else {"type": "function", "function": {"name": name}}
    effort = req.reasoning.get("effort") if isinstance(req.reasoning, dict) else None
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(f"reasoning.effort must be one of {', '.join(EFFORTS)}", param="reasoning.effort")
        body["reasoning_effort"] = effort
    fmt = (req.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object such as {\"type\": \"json_schema\", ...}",
                          param="text.format", code="invalid_type")
    if fmt is not None and fmt.get("type") == "json_schema" and not isinstance(fmt.get("name"), str):
        raise bad_request("text.format of type json_schema needs its name", param="text.format.name")
    if fmt is not None and fmt.get("type") != "text":
        body["response_format"] = ({"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
            if fmt.get("type") == "json_schema" else {"type": fmt.get("type")})
    body.update(constraint_fields(req))     # checked with text.format by structured.output_constraint
    return chat_request(body, ResponsesChat)


def _text(content: Any, i: int) -> str:
    return join_text(content, TEXT_PARTS, f"input[{i}].content")


def _call_name(item: dict[str, Any], i: int) -> str:
    if not isinstance(item.get("name"), str):
        raise bad_request(f"input[{i}].name: a function_call item needs the function's name", param=f"input[{i}].name")
    return item["name"]


def _arguments(item: dict[str, Any], i: int) -> Any:
    """A function_call item's arguments, refused where chat's would be (text that is not JSON)."""
    args = item.get("arguments", "")
    if isinstance(args, str) and args:
        try:
            json.loads(args)
        except ValueError:
            raise bad_request(f"input[{i}].arguments is not JSON", param=f"input[{i}].arguments") from None
    return args


def _tool(t: dict[str, Any], i: int) -> dict[str, Any]:
    if t.get("type") != "function":
        raise bad_request(f"tools[{i}].type {t.get('type')!r} is not supported (function is)",
                          param=f"tools[{i}].type", code="unsupported_parameter")
    return {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def shell(req: ResponsesRequest, rid: str, created: int, model: str, status: str) -> dict[str, Any]:
    """A Response without output: what every event that carries the response starts from."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": [], "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": True,
            "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {}, "store": False,
            "usage": None}


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _finish(resp: dict[str, Any], finish: str | None) -> dict[str, Any]:
    if finish == "length":
        resp["status"], resp["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        resp["status"] = "completed"
    return resp


def message_item(text: str, status: str = "completed", iid: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": iid or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def reasoning_item(text: str, iid: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": iid or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict[str, Any], status: str = "completed", iid: str | None = None) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"type": "function_call", "id": iid or new_id("fc"), "call_id": call.get("id"), "name": fn.get("name"),
            "arguments": fn.get("arguments", "") if status == "completed" else "", "status": status}


def from_chat(chat: dict[str, Any], req: ResponsesRequest, rid: str) -> dict[str, Any]:
    """A whole chat completion (one choice) as the Response."""
    choice = chat["choices"][0]
    msg = choice["message"]
    resp = shell(req, rid, chat["created"], chat["model"], "completed")
    if msg.get("reasoning_content"):
        resp["output"].append(reasoning_item(msg["reasoning_content"]))
    if msg.get("content") or not msg.get("tool_calls"):
        resp["output"].append(message_item(msg.get("content") or ""))
    resp["output"] += [call_item(c) for c in msg.get("tool_calls") or []]
    resp["usage"] = usage(chat["usage"])
    return _finish(resp, choice["finish_reason"])


class EventWriter:
    """Chat stream chunks in, Responses stream events out: reasoning text, then the message's
    text, then the calls, each an output item opened, filled by deltas and closed in order."""

    def __init__(self, req: ResponsesRequest, rid: str, created: int, model: str) -> None:
        self.resp = shell(req, rid, created, model, "in_progress")
        self.seq = 0
        self.open: tuple[str, dict[str, Any], list[str]] | None = None   # (kind, item, text so far)
        self.finish: str | None = None

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        return [self._ev("response.created", response=dict(self.resp)),
                self._ev("response.in_progress", response=dict(self.resp))]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._close()
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _open(self, kind: str) -> list[dict[str, Any]]:
        """Close the open item and open a reasoning or message item."""
        out = self._close()
        item = reasoning_item("") if kind == "reasoning" else message_item("", "in_progress")
        self.open = (kind, item, [])
        idx = len(self.resp["output"])
        out.append(self._ev("response.output_item.added", output_index=idx, item=item))
        if kind == "message":
            out.append(self._ev("response.content_part.added", item_id=item["id"], output_index=idx,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        out = self._open(kind) if self.open is None or self.open[0] != kind else []
        self.open[2].append(delta)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        out.append(self._ev(name, item_id=self.open[1]["id"], output_index=len(self.resp["output"]),
                            content_index=0, delta=delta))
        return out

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        kind, item, parts = self.open
        self.open, text, idx = None, "".join(parts), len(self.resp["output"])
        if kind == "reasoning":
            done = reasoning_item(text, item["id"])
            out = [self._ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                            text=text)]
        else:
            done = message_item(text, "completed", item["id"])
            part = done["content"][0]
            out = [self._ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                            text=text),
                   self._ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                            part=part)]
        self.resp["output"].append(done)
        return out + [self._ev("response.output_item.done", output_index=idx, item=done)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        idx, done = len(self.resp["output"]), call_item(call)
        args = done["arguments"]
        out = [self._ev("response.output_item.added", output_index=idx, item=call_item(call, "in_progress", done["id"])),
               self._ev("response.function_call_arguments.delta", item_id=done["id"], output_index=idx, delta=args),
               self._ev("response.function_call_arguments.done", item_id=done["id"], output_index=idx, arguments=args),
               self._ev("response.output_item.done", output_index=idx, item=done)]
        self.resp["output"].append(done)
        return out

    def error(self, err: Any) -> dict[str, Any]:
        """The stream's error event (the engine failed this answer)."""
        return self._ev("error", code=err.code, message=err.message, param=err.param)

    def end(self, chat_usage: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        if not self.resp["output"]:            # an answer with no text at all: still one message
            out += self._open("message") + self._close()
        self.resp["usage"] = usage(chat_usage)
        _finish(self.resp, self.finish)
        kind = "response.incomplete" if self.resp["status"] == "incomplete" else "response.completed"
        return out + [self._ev(kind, response=self.resp)]
