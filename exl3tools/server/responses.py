"""OpenAI response and stream-chunk bodies, built from engine Events."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import orjson

from exl3tools.server.detok import TokenText
from exl3tools.server.reasoning import ThinkSplitter
from exl3tools.server.requests import Event, TokenLogprob
from exl3tools.server.tools import CallReader


@dataclass(slots=True)
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None     # the stop string or token id that ended it (Event's)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # echo with logprobs


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
                 logprobs: bool, token_ids: bool = False, calls: CallReader | None = None,
                 think: ThinkSplitter | None = None, echo: list[str] | None = None, n: int = 1) -> None:
        self.chat, self.rid, self.created, self.model = chat, rid, created, model
        # completions' echo: each prompt's text before its choices' text (choice i: prompt i // n),
        # with logprobs the prompt's tokens before the completion's
        self._echo, self._n, self._echoed = echo, n, set()
        self._tokens, self._logprobs = tokens, logprobs
        self._token_ids = token_ids
        self._started: set[int] = set()
        self._calls = calls if chat else None    # tool calls read out of the answers (server/tools.py)
        self._think = think if chat else None    # thinking apart from the answer (server/reasoning.py)

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

    def _legacy_lp(self, entries: list[TokenLogprob], index: int) -> dict[str, Any]:
        # a completion token's offset is the detokenizer's (TokenLogprob.offset), after the echoed
        # prompt; summing display strings ("bytes:\\xNN" for a byte token) overshot the text
        base = len(self._echo[index // self._n]) if self._echo is not None else 0
        tokens, offsets, offset = [], [], 0
        for e in entries:
            s = self._token_str(e.token_id)
            tokens.append(s)
            if e.offset is not None:
                offset = base + e.offset
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.top is None else {self._token_str(t): lp for t, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}

    def _lp(self, entries: list[TokenLogprob], index: int) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        return self._chat_lp(entries) if self.chat else self._legacy_lp(entries, index)

    # ------------------------------------------------------------ whole responses

    def response(self, choices: list[Choice], prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int = 0, spec: tuple[int, int] = (0, 0)) -> dict:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            text = "".join(c.text)
            body: dict[str, Any] = {"index": c.index}
            finish = c.finish_reason
            reasoning = None
            if self._think is not None:           # the calls are read in what follows the thinking
                reasoning, text = self._think.split(c.index, text)
            if self._calls is not None:
                body["message"], finish = self._calls.message(text, finish)
            elif self.chat:
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["text"] = text if self._echo is None else self._echo[c.index // self._n] + text
            if reasoning is not None:
                body["message"]["reasoning_content"] = reasoning
            body["logprobs"] = self._lp(c.prompt_logprobs + c.logprobs, c.index)
            body["finish_reason"] = finish
            body["stop_reason"] = c.stop_reason if finish == "stop" else None    # (as vLLM's)
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

    def chunks(self, ev: Event) -> list[dict]:
        """Zero, one or two chunks for one event (chat opens each choice with its role)."""
        out = []
        if self.chat and ev.index not in self._started:
            self._started.add(ev.index)
            out.append(self._chunk([{"index": ev.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        text, reasoning = ev.text, ""
        if self._think is not None:
            reasoning, text = self._think.feed(ev.index, text)
            if ev.finish_reason is not None:
                more = self._think.finish(ev.index)
                reasoning, text = reasoning + more[0], text + more[1]
        if self._calls is not None:
            text = self._calls.feed(ev.index, text)
        entries = ev.logprobs or []
        if self._echo is not None and ev.index not in self._echoed:     # the choice's first chunk
            self._echoed.add(ev.index)
            ev.text = text = self._echo[ev.index // self._n] + ev.text
            entries = (ev.prompt_logprobs or []) + entries
        if (not text and not reasoning and ev.finish_reason is None and not (self._logprobs and entries)
                and not self._token_ids):
            return out
        lp = self._lp(entries, ev.index)
        if self.chat:
            delta, finish = ({"content": text} if text else {}), ev.finish_reason
            if self._calls is not None and finish is not None:   # the calls in one delta, as OpenAI's
                last, finish = self._calls.finish(ev.index, finish)   # clients accumulate them
                if "content" in last:
                    last["content"] = delta.pop("content", "") + last["content"]
                delta.update(last)
            if reasoning:
                delta = {"reasoning_content": reasoning, **delta}
            choice = {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": ev.index, "text": ev.text, "logprobs": lp,
                      "finish_reason": ev.finish_reason}
        if self._token_ids:
            choice["token_ids"] = ev.token_ids
        if choice["finish_reason"] == "stop":        # the last chunk: what stopped it (as vLLM's)
            choice["stop_reason"] = ev.stop_reason
        out.append(self._chunk([choice]))
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                    spec: tuple[int, int] = (0, 0)) -> dict:
        return self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens, spec))


DONE = "data: [DONE]\n\n"


class ChatStream:
    """A completion or chat completion stream's text: each event's chunks, the usage chunk if
    asked for, then [DONE]."""

    def __init__(self, fmt: Formatter, include_usage: bool) -> None:
        self.fmt, self.include_usage = fmt, include_usage

    def start(self) -> str:
        return ""

    def feed(self, ev: Event) -> str:
        return "".join(sse(chunk, bool(ev.logprobs)) for chunk in self.fmt.chunks(ev))

    def error(self, err: Any) -> str:
        return sse(err.body()) + DONE

    def end(self, handle: Any) -> str:
        if not self.include_usage:
            return DONE
        return sse(self.fmt.usage_chunk(handle.prompt_tokens, handle.completion_tokens, handle.cached_tokens,
                                        (handle.accepted_tokens, handle.rejected_tokens))) + DONE


def event_sse(ev: dict[str, Any]) -> str:
    """One named server-sent event (``event:`` its type), as the Responses and Messages APIs send them."""
    return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream:
    """Another API's stream (the Responses or Messages API) over a chat stream's chunks: its
    ``writer`` turns them into its events (start, feed(chunk), error(err), end(usage)), each a
    named event (``event_sse``)."""

    def __init__(self, fmt: Formatter, writer: Any) -> None:
        self.fmt, self.writer = fmt, writer

    def start(self) -> str:
        return "".join(map(event_sse, self.writer.start()))

    def feed(self, ev: Event) -> str:
        return "".join(event_sse(e) for chunk in self.fmt.chunks(ev) for e in self.writer.feed(chunk))

    def error(self, err: Any) -> str:
        return event_sse(self.writer.error(err))

    def end(self, handle: Any) -> str:
        return "".join(map(event_sse, self.writer.end(usage(handle.prompt_tokens, handle.completion_tokens,
                                                            handle.cached_tokens))))
