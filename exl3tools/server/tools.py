"""Tool calls: chat's ``tools`` with ``tool_choice`` "required", a named function, or "auto".

Forced ("required" or a named function): the answer is held to one call by a grammar
(server/structured.py), a JSON object ``{"name": <a tool's name>, "arguments": <that tool's
parameters schema>}`` whatever the model's own tool-call syntax, and comes back as OpenAI's
``message.tool_calls`` (one call, its ``arguments`` a JSON string) with ``finish_reason``
"tool_calls".

"auto" (OpenAI's default when tools are given): the model decides, in its own syntax, which
``call_syntax`` recognises from the chat template: Hermes-style JSON (``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``: Qwen3 and others), GLM's XML (``<tool_call>name<arg_key>k
</arg_key><arg_value>v</arg_value></tool_call>``: GLM-4.5 and later) or DeepSeek's marker tokens
(``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name`` and the arguments in a
json fence, V3; ``...begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``, V3.1 and later). Text
before the first call marker streams as content; the rest is held back and parsed when the answer
ends; a call that does not parse comes back as text. The content is the text around the calls less
the whitespace before each call and at the end, streamed or whole (the stream holds trailing
whitespace back until text follows). The markers reach that text even where the
tokenizer makes them special tokens (detok.keeping). A template with none of these syntaxes makes
"auto" a 400. "none" renders the tools and generates text. The tools reach the chat template as
``tools`` either way.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from exl3tools.server.api_errors import bad_request
from exl3tools.server.detok import held_prefix
from exl3tools.server.request_models import ChatCompletionRequest
from exl3tools.server.structured import output_constraint

MAX_TOOLS = 128


@dataclass(frozen=True, slots=True)
class ToolMode:
    """What a request's tools ask of the answer (``tool_mode``)."""

    forced: list[Any] | None = None        # one of these functions must be called (a grammar holds it)
    syntax: CallSyntax | None = None       # "auto": calls in the model's own syntax, parsed afterwards
    functions: tuple = ()                  # the tools' functions (argument types for GLM's values)


def tool_mode(req: ChatCompletionRequest, syntax: CallSyntax | None) -> ToolMode:
    """``req``'s tools and tool_choice as a ToolMode (``syntax``: the template's call syntax, or
    None); 400s for what cannot be served."""
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
    functions = tuple(t.function for t in tools or ())
    if choice == "none" or not tools and choice in (None, "auto"):
        return ToolMode()
    if choice in (None, "auto"):
        if syntax is None:
            raise _auto_refused()
        return ToolMode(syntax=syntax, functions=functions)
    if not tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    if choice == "required":
        return _forced(req, list(functions), functions)
    name = _named(choice)
    for fn in functions:
        if fn.name == name:
            return _forced(req, [fn], functions)
    raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")


def _forced(req: ChatCompletionRequest, forced: list[Any], functions: tuple) -> ToolMode:
    """A forced call's ToolMode, refused where another rule would hold the answer open or shape it."""
    constraint = output_constraint(req)
    if constraint is not None:
        raise bad_request(f"a forced tool call and {constraint.param} cannot be combined", param=constraint.param)
    if req.ignore_eos or req.min_tokens:
        # a finished call allows only EOS (as structured.output_constraint says of the others)
        raise bad_request("a forced tool call cannot be combined with "
                          f"{'ignore_eos' if req.ignore_eos else 'min_tokens'}", param="tool_choice")
    return ToolMode(forced=forced, functions=functions)


def _auto_refused():
    return bad_request("tool_choice \"auto\" (the default with tools) is not supported for this model: its chat "
                       "template shows no tool-call syntax this server reads (Hermes <tool_call> JSON, GLM "
                       "<arg_key>/<arg_value>, DeepSeek <｜tool▁call▁begin｜>); send tool_choice \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}} to force a call, or \"none\"", param="tool_choice",
                       code="unsupported_parameter")


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


def _call(name: str, arguments: Any) -> dict:
    """One entry of OpenAI's ``tool_calls``."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "))}}


def _json_call(text: str) -> dict | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments", {}), dict)):
        return None
    return _call(obj["name"], obj.get("arguments", {}))


def tool_calls(text: str) -> list[dict] | None:
    """A forced call's JSON as OpenAI's ``tool_calls`` (one entry), None when ``text`` is not a
    complete call (``max_tokens`` ran out first)."""
    call = _json_call(text)
    return None if call is None else [call]


START = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
# DeepSeek-V3 and later: marker tokens (｜ is U+FF5C, ▁ U+2581); calls sit in one calls region
DS_START, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DS_BLOCK = re.compile(re.escape(DS_CALL) + r"(.*?)" + re.escape(DS_CALL_END), re.DOTALL)
_DS_REGION = re.compile(re.escape(DS_START) + r".*?(?:" + re.escape(DS_END) + r"|$)", re.DOTALL)
_DS_FENCE = re.compile(r"\s*(\S+)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)   # V3: name, then fenced JSON


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """A model family's tool-call syntax: every call a ``<tool_call>...</tool_call>`` block whose
    body is JSON ("hermes") or GLM's name and <arg_key>/<arg_value> pairs ("glm"), or a
    ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` block inside DeepSeek's calls region ("deepseek")."""

    family: str

    @property
    def markers(self) -> frozenset[str]:
        """The tokens this syntax is read by, which the answers' text must keep (detok.keeping)."""
        if self.family == "deepseek":
            return frozenset({DS_START, DS_END, DS_CALL, DS_SEP, DS_CALL_END})
        glm = {"<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"} if self.family == "glm" else set()
        return frozenset({START, "</tool_call>", *glm})

    @property
    def start(self) -> str:
        """The marker from which an answer's text is held back for parsing."""
        return DS_START if self.family == "deepseek" else START

    def parse(self, text: str, functions: tuple = ()) -> tuple[str, list[dict]] | None:
        """(the text outside the blocks, the calls) when ``text`` holds at least one block and
        every block parses; None otherwise (the answer is then plain text)."""
        deepseek = self.family == "deepseek"
        bodies = (_DS_BLOCK if deepseek else _BLOCK).findall(text)
        if not bodies:
            return None
        one = {"hermes": self._json, "glm": lambda b: self._glm(b, functions), "deepseek": self._deepseek}[self.family]
        calls = [one(b) for b in bodies]
        if any(c is None for c in calls):
            return None
        outside = _DS_REGION.split(text) if deepseek else _BLOCK.split(text)[::2]
        return _content(outside), calls

    @staticmethod
    def _deepseek(body: str) -> dict | None:
        head, sep, rest = body.partition(DS_SEP)
        if not sep:
            return None
        if head.strip() == "function":          # V3: function<｜tool▁sep｜>name, a json fence
            m = _DS_FENCE.fullmatch(rest)
            if m is None:
                return None
            name, args = m.group(1), m.group(2)
        else:                                   # V3.1 and later: name<｜tool▁sep｜>{arguments}
            name, args = head.strip(), rest.strip()
        try:
            arguments = json.loads(args)
        except ValueError:
            return None
        if not name or not isinstance(arguments, dict):
            return None
        return _call(name, arguments)

    @staticmethod
    def _json(body: str) -> dict | None:
        return _json_call(body.strip())

    @staticmethod
    def _glm(body: str, functions: tuple) -> dict | None:
        name, _, rest = body.partition("<arg_key>")
        name = name.strip()
        if not name or "<" in name:
            return None
        rest = "<arg_key>" + rest if rest else ""
        pairs = _GLM_ARG.findall(rest)
        if _GLM_ARG.sub("", rest).strip():
            return None                          # text between the pairs that is not a pair
        props = next(((fn.parameters or {}).get("properties", {}) for fn in functions if fn.name == name), {})
        args = {}
        for key, value in pairs:
            key = key.strip()
            kind = props.get(key, {}).get("type") if isinstance(props.get(key), dict) else None
            args[key] = value if kind == "string" else _loads_or_text(value)
        return _call(name, args)


def _content(outside: list[str]) -> str:
    """The text around an answer's calls (``outside``: the pieces before, between and after them)
    as its content: whitespace before each call and at the end is dropped, so what streamed
    before the first call (``CallReader.feed`` holds trailing whitespace back) is never retracted."""
    return ("".join(p.rstrip() for p in outside[:-1]) + outside[-1]).rstrip()


def _loads_or_text(value: str) -> Any:
    """GLM writes every value as text: a non-string parameter's value is JSON when it parses."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def call_syntax(template: str | None) -> CallSyntax | None:
    """The call syntax a chat template shows, None when it shows none this server reads. Where the
    tokenizer makes its markers special tokens, the server decodes the answers with them as text
    (detok.keeping), so the parser still sees them."""
    if not template:
        return None
    if DS_CALL in template and DS_SEP in template:
        return CallSyntax("deepseek")
    if START in template:
        return CallSyntax("glm" if "<arg_key>" in template else "hermes")
    return None


@dataclass(slots=True)
class CallReader:
    """One request's answers read for tool calls: the forced call's JSON, or an "auto" answer's
    blocks in the model's syntax (``mode.syntax``). Streaming: text goes out until the syntax's first
    marker begins (a partial marker at the end is held until it resolves, and whitespace at the end
    until text follows: before a call it is not content); the rest waits for the end."""

    mode: ToolMode
    _held: dict[int, str] = field(default_factory=dict)
    _holding: set[int] = field(default_factory=set)

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole answer's message and finish reason."""
        content, calls = text, None
        if finish == "stop" and self.mode.forced is not None:
            calls = tool_calls(text)
            content = None if calls else text
        elif finish == "stop" and self.mode.syntax is not None:
            parsed = self.mode.syntax.parse(text, self.mode.functions)
            if parsed is not None:
                content, calls = parsed[0] or None, parsed[1]
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def feed(self, index: int, text: str) -> str:
        """The part of ``text`` that may stream now; the rest is held."""
        held = self._held.get(index, "") + text
        if self.mode.forced is not None or index in self._holding:
            self._held[index] = held
            return ""
        start = self.mode.syntax.start
        at = held.find(start)
        if at >= 0:
            self._holding.add(index)
        else:
            at = len(held) - held_prefix(held, start)
        at = len(held[:at].rstrip())         # whitespace before a call is no content (_content)
        self._held[index] = held[at:]
        return held[:at]

    def finish(self, index: int, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The last delta of a streamed answer: the held text as calls, or as content."""
        held = self._held.pop(index, "")
        self._holding.discard(index)
        message, finish = self.message(held, finish)
        delta: dict[str, Any] = {}
        if message.get("content"):
            delta["content"] = message["content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        return delta, finish


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as the chat template gets them (OpenAI's shape, unset fields left out)."""
    if not req.tools:
        return None
    return [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
