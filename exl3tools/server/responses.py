"""OpenAI response and stream-chunk bodies, built from engine Events."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import orjson

from exl3tools.server.detok import TokenText
from exl3tools.server.requests import Event, TokenLogprob
from exl3tools.server.tools import tool_calls


@dataclass(slots=True)
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          spec: tuple[int, int] = (0, 0)) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix
    cache served (as OpenAI and vLLM report them); with speculative decoding,
    ``completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens``: the
    MTP drafts the model kept / threw away (OpenAI's fields for predicted tokens)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if any(spec):
        out["completion_tokens_details"] = {"accepted_prediction_tokens": spec[0],
                                            "rejected_prediction_tokens": spec[1]}
    return out


def sse(obj: Any, floats: bool = False) -> str:
    """One server-sent event. orjson (C) writes the compact UTF-8 JSON json.dumps would, at a
    fraction of the cost the event loop pays per token and stream. A chunk with floats (logprobs)
    goes through json: orjson would write a -inf logprob as null; so does what orjson refuses."""
    if not floats:
        try:
            return f"data: {orjson.dumps(obj, option=orjson.OPT_STRICT_INTEGER).decode()}\n\n"
        except TypeError:
            pass
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Formatter:
    """Shapes one request's events as a completion or a chat completion."""

    def __init__(self, *, chat: bool, rid: str, created: int, model: str, tokens: TokenText,
                 logprobs: bool, token_ids: bool = False, tool_call: bool = False) -> None:
        self.chat, self.rid, self.created, self.model = chat, rid, created, model
        self._tokens, self._logprobs = tokens, logprobs
        self._token_ids = token_ids
        self._started: set[int] = set()
        # a forced tool call (server/tools.py): its JSON is held back and sent as tool_calls
        self._tool_call = tool_call
        self._held: dict[int, list[str]] = {}

    def _message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat answer's message and finish reason: a forced call's JSON as ``tool_calls``
        (finish "tool_calls"), or, when it did not complete (max_tokens), the text as it is."""
        calls = tool_calls(text) if self._tool_call and finish == "stop" else None
        if calls is None:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    # ------------------------------------------------------------ logprobs

    def _token_str(self, token_id: int) -> str:
        return self._tokens.get(token_id)[0]

    def _chat_lp(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        def one(tid: int, lp: float) -> dict[str, Any]:
            s, raw = self._tokens.get(tid)
            return {"token": s, "logprob": lp, "bytes": list(raw)}
        return {"content": [{**one(e.token_id, e.logprob),
                             "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries],
                "refusal": None}

    def _legacy_lp(self, entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens, offsets = [], []
        for e in entries:
            s = self._token_str(e.token_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token_str(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _lp(self, entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        return self._chat_lp(entries) if self.chat else self._legacy_lp(entries, offset)

    # ------------------------------------------------------------ whole responses

    def response(self, choices: list[Choice], prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int = 0, spec: tuple[int, int] = (0, 0)) -> dict:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            text = "".join(c.text)
            body: dict[str, Any] = {"index": c.index}
            finish = c.finish_reason
            if self.chat:
                body["message"], finish = self._message(text, finish)
            else:
                body["text"] = text
            body["logprobs"] = self._lp(c.logprobs)
            body["finish_reason"] = finish
            if self._token_ids:
                body["token_ids"] = c.token_ids
            out.append(body)
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None,
                "choices": out, "usage": usage(prompt_tokens, completion_tokens, cached_tokens, spec)}

    # ------------------------------------------------------------ stream chunks

    def _chunk(self, choices: list[dict], usage_obj: dict | None = None) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None,
                "choices": choices, "usage": usage_obj}

    def chunks(self, ev: Event, text_offset: int = 0) -> list[dict]:
        """Zero, one or two chunks for one event (chat opens each choice with its role)."""
        out = []
        if self.chat and ev.index not in self._started:
            self._started.add(ev.index)
            out.append(self._chunk([{"index": ev.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        if ((not ev.text or self._tool_call) and ev.finish_reason is None
                and not (self._logprobs and ev.logprobs) and not self._token_ids):
            if self._tool_call:
                self._held.setdefault(ev.index, []).append(ev.text)
            return out
        lp = self._lp(ev.logprobs or [], text_offset)
        if self.chat and self._tool_call:
            held = self._held.setdefault(ev.index, [])
            held.append(ev.text)
            delta, finish = {}, ev.finish_reason
            if finish is not None:          # the whole call in one delta, as OpenAI's clients accumulate it
                message, finish = self._message("".join(held), finish)
                delta = ({"content": message["content"]} if message["content"] else
                         {"tool_calls": [{"index": 0, **c} for c in message.get("tool_calls", [])]})
            choice = {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        elif self.chat:
            delta = {"content": ev.text} if ev.text else {}
            choice = {"index": ev.index, "delta": delta, "logprobs": lp,
                      "finish_reason": ev.finish_reason}
        else:
            choice = {"index": ev.index, "text": ev.text, "logprobs": lp,
                      "finish_reason": ev.finish_reason}
        if self._token_ids:
            choice["token_ids"] = ev.token_ids
        out.append(self._chunk([choice]))
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                    spec: tuple[int, int] = (0, 0)) -> dict:
        return self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens, spec))
