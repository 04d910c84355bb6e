"""The engine's sampling and emission: a step's rows sampled on the logits' device (batched, with
each sequence's logits processing and generator; row by row when the batch fails), the tokens read
once a step and emitted as events with their logprobs, stop strings and finish reasons. A mixin of
server.engine.Engine, beside engine_spec's and engine_scoring's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from exl3tools.server.requests import Event, Sequence, TokenLogprob

if TYPE_CHECKING:
    from exl3tools.server.engine import _Inflight

log = logging.getLogger("exl3tools.serve")


class TokenSampling:
    """Engine methods that turn a step's logits into emitted tokens."""

    def _launch_sample(self, logits: Any, ready: list[tuple[int, Sequence]]) -> Any:
        """The ready rows' tokens, sampled on the logits' device without a host sync (None: no
        device sampler; ``_sample_ready`` samples)."""
        if not ready:
            return None
        return self._sample_rows(self._sample_device_fn, logits, ready, "device sampling failed")

    def _sample_rows(self, fn: Callable | None, logits: Any, ready: list[tuple[int, Sequence]], what: str) -> Any:
        """``fn`` (a batched sampler) over the ready rows, each with its processed logits, settings
        and generator; None when there is no ``fn`` or it fails (then rows are sampled one by one)."""
        self._ensure_generators(ready, logits.device)   # also for the row-by-row fallback
        if fn is None:
            return None
        rows = [i for i, _ in ready]
        ps = [seq.params for _, seq in ready]
        try:
            sub = self._adjusted(logits if rows == list(range(len(logits))) else logits[rows], ready)
            return fn(sub, [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                      [seq.generator if p.temperature > 0 else None for p, (_, seq) in zip(ps, ready, strict=True)])
        except Exception:
            log.warning("%s; sampling row by row", what, exc_info=True)
            return None

    def _ensure_generators(self, ready: list[tuple[int, Sequence]], device: Any) -> None:
        for _, seq in ready:
            if seq.params.temperature > 0 and not hasattr(seq.generator, "manual_seed"):
                seq.generator = self._make_gen(seq.generator, device=device)
            if seq.adjust is None and seq.params.adjusts_logits:
                if self._make_adjust is None:
                    raise RuntimeError("this engine has no logits processing (make_adjust)")
                p, runner = seq.params, self.runner
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(runner.eos_token_ids))
                seq.adjust = self._make_adjust(p, seq.prompt, banned, runner.vocab_size, device)

    def _adjusted(self, sub: Any, ready: list[tuple[int, Sequence]]) -> Any:
        """The ready rows' logits with each sequence's processing applied (penalties, bias...)."""
        if not any(seq.adjust is not None for _, seq in ready):
            return sub
        return self._adjust_rows(sub, [seq.adjust for _, seq in ready])

    def _sample_ready(self, fl: _Inflight, nxt: _Inflight | None) -> None:
        """Read ``fl``'s tokens (the one host sync of a step) and emit them; tell the runner the
        tokens ``nxt`` (chained on them) wrote. Without device tokens: all rows in one sampler
        call; if that fails (a NaN row), row by row, so only the broken sequence fails. The
        tokens' time (TTFT, ITL) is taken once they are on the host: before the sync the GPU may
        still be running the step (a long prompt's last chunk: tens of ms)."""
        logits, ready = fl.logits, fl.ready
        tokens = None
        if fl.tokens is not None:
            try:
                tokens = [t if t >= 0 else None for t in fl.tokens.tolist()]
            except Exception:
                log.exception("reading sampled tokens failed")
        if nxt is not None:
            known = {id(seq): t for t, (_, seq) in zip(tokens or [None] * len(ready), ready, strict=True)}
            self.runner.commit_tokens([(s.seq_id, known[id(s)]) for _, s in nxt.ready
                                       if known.get(id(s)) is not None])
        if tokens is None and fl.tokens is None:
            tokens = self._sample_rows(self._sample_batch_fn, logits, ready, "batched sampling failed")
        now = time.monotonic()
        for j, (i, seq) in enumerate(ready):
            if seq.finished:        # cancelled, or stopped at the step this one was chained on
                continue
            try:
                self._sample(seq, logits[i], now, None if tokens is None else tokens[j])
            except Exception:
                log.exception("sampling failed")
                self._fail(seq)

    def _sample(self, seq: Sequence, row: Any, now: float, token: int | None = None) -> None:
        """Emit one token for ``seq``: ``token`` if the batched sampler drew it, else drawn here
        (then its time is taken after the draw, which waits for the step)."""
        p = seq.params
        if token is None:
            if p.temperature > 0 and not hasattr(seq.generator, "manual_seed"):
                seq.generator = self._make_gen(seq.generator, device=row.device)
            gen = seq.generator if p.temperature > 0 else None
            token = int(self._sample_fn(row if seq.adjust is None else seq.adjust.apply(row), p.temperature,
                                        p.top_k, p.top_p, gen))
            now = time.monotonic()
        ev = Event(seq.index, token_ids=[token])
        if p.logprobs is not None:
            lp, top = self._logprobs_fn(row, token, p.logprobs)
            ev.logprobs = [TokenLogprob(token, lp, top, seq.tracker.offset)]
        seq.output_ids.append(token)
        if seq.adjust is not None:
            seq.adjust.add(token)
        seq.handle.completion_tokens += 1
        self._observe_token(seq, now)
        runner = self.runner
        if (token in runner.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            ev.text, ev.finish_reason = seq.tracker.flush(), "stop"
            if token in p.stop_token_ids:
                ev.stop_reason = token
        else:
            ev.text, hit = seq.tracker.add(token)
            if hit:
                ev.finish_reason, ev.stop_reason = "stop", seq.tracker.matched
            elif (len(seq.output_ids) >= p.max_tokens
                  or len(seq.prompt) + len(seq.output_ids) >= runner.max_context):
                ev.text += seq.tracker.flush()
                ev.finish_reason = "length"
        if ev.finish_reason is not None:
            seq.finished = True
        seq.handle.push(ev)

    def _observe_token(self, seq: Sequence, now: float) -> None:
        m = self.metrics
        if m is None:
            return
        if len(seq.output_ids) == 1:
            m.ttft.observe(now - seq.handle.t_received)   # as the client waits: parsing and templating count
        else:
            m.itl.observe(now - seq.t_last)
        seq.t_last = now
        m.generation_tokens.inc()
