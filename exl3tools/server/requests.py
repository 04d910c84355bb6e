"""What a request leaves with the engine: its sequences (one per choice), the events each step
sends back, and the handle the event loop holds (an asyncio queue of events, and cancel())."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from exl3tools.server.api_errors import APIError
from exl3tools.server.detok import TextTracker
from exl3tools.server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from exl3tools.server.engine import Engine


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None                   # None (and top None): a prompt's first token (echo)
    top: list[tuple[int, float]] | None
    # completions' text_offset: where the token's text starts in the completion's text (the
    # detokenizer's, so byte tokens and held-back stop-string text count right); None: a prompt
    # token's (echo), placed by the display strings before it
    offset: int | None = None


@dataclass(slots=True)
class Event:
    """One step's output for one choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    # echo with logprobs: the prompt's tokens, each with its logprob (None for the first: nothing
    # before it), sent once, before the choice's first token
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    # what stopped a "stop" finish (vLLM's choice.stop_reason): the stop string matched, the stop
    # token id, or None for an EOS token
    stop_reason: str | int | None = None
    error: APIError | None = None


class Sequence:
    __slots__ = ("seq_id", "index", "prompt", "params", "handle", "output_ids", "num_cached",
                 "tracker", "generator", "finished", "t_last", "adjust", "prompt_lps")

    def __init__(self, seq_id: int, index: int, prompt: list[int], params: SamplingParams,
                 handle: RequestHandle, tracker: TextTracker) -> None:
        self.seq_id, self.index, self.prompt, self.params = seq_id, index, prompt, params
        self.handle, self.tracker = handle, tracker
        self.output_ids: list[int] = []
        self.num_cached = 0  # tokens of this sequence in the runner's cache
        self.generator: Any = None  # made lazily on the logits' device
        self.finished = False
        self.t_last = 0.0
        self.adjust: Any = None     # logits processing state (penalties, bias...), made on first use
        # params.prompt_logprobs (echo with logprobs): one entry per prompt token so far; None
        # once sent (Engine._end_prompt)
        self.prompt_lps: list[TokenLogprob] | None = []

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's logprobs are still to be computed (echo with logprobs): its
        prefill steps return every row's logits, and it takes no prefix-cache blocks."""
        return self.params.prompt_logprobs is not None and self.prompt_lps is not None

    @property
    def pending(self) -> int:
        """Tokens of prompt + output not yet in the cache: 1 while decoding (the last sampled
        token), the whole prompt before prefill, prompt + output after a preemption."""
        return len(self.prompt) + len(self.output_ids) - self.num_cached

    def next_chunk(self, limit: int) -> list[int]:
        start = self.num_cached
        end = min(start + limit, len(self.prompt) + len(self.output_ids))
        n_prompt = len(self.prompt)
        if start >= n_prompt:
            return self.output_ids[start - n_prompt:end - n_prompt]
        return self.prompt[start:min(end, n_prompt)] + self.output_ids[:max(0, end - n_prompt)]


class RequestHandle:
    """The event loop's side of a request: an asyncio queue of Events, and cancel()."""

    def __init__(self, engine: Engine, loop: Any, n_seqs: int, prompt_tokens: int,
                 received: float | None = None, n: int = 1) -> None:
        import asyncio

        self._engine, self._loop = engine, loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.seqs: list[Sequence] = []
        self.remaining = n_seqs
        self.prompt_tokens = prompt_tokens
        self.n = n                   # choices per prompt
        self._cached: dict[int, int] = {}   # prompt -> its tokens the prefix cache served
        self.accepted_tokens = self.rejected_tokens = 0   # MTP drafts (speculative decoding)
        self.completion_tokens = 0
        self.t_arrival = time.monotonic()       # queued
        self.t_received = self.t_arrival if received is None else received   # reached the server
        self.cancelled = False

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, each prompt once (as prompt_tokens counts
        them): summed over n choices, or again at a re-admission, they exceeded prompt_tokens."""
        return sum(self._cached.values())

    def note_cached(self, seq: Sequence) -> None:  # engine thread: ``seq`` admitted
        if not seq.output_ids:       # (a preempted one's recomputed history is no prompt hit)
            self._cached.setdefault(seq.index // self.n, seq.num_cached)

    def push(self, ev: Event) -> None:  # engine thread: delivered in one batch after the step
        self._engine._outbox.append((self, ev))

    def cancel(self) -> None:  # event loop; idempotent
        if not self.cancelled and self.remaining > 0:
            self.cancelled = True
            self._engine.wake()

    async def events(self, ping: float | None = None):
        """Lists of events (all that are ready) until every choice finished; an empty list every
        `ping` seconds of silence."""
        import asyncio

        while self.remaining > 0:
            try:
                evs = [await asyncio.wait_for(self.queue.get(), ping)]
            except asyncio.TimeoutError:
                yield []
                continue
            while not self.queue.empty():
                evs.append(self.queue.get_nowait())
            self.remaining -= sum(ev.finish_reason is not None or ev.error is not None for ev in evs)
            yield evs


def deliver(items: list[tuple[RequestHandle, Event]]) -> None:  # event loop
    for handle, ev in items:
        handle.queue.put_nowait(ev)
