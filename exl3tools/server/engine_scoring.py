"""The engine's prompt scoring (completions' ``echo`` with ``logprobs``, lm-eval's loglikelihood
requests): a scored prompt's prefill rows become its prompt tokens' logprobs, sent once before
its first token, and a max_tokens 0 choice ends there. A mixin of server.engine.Engine; the
planner cuts a scored prompt into SCORED_CHUNK rows (server/planner.py)."""

from __future__ import annotations

import itertools
from typing import Any

from exl3tools.server.requests import Event, Sequence, TokenLogprob


class PromptScoring:
    """Engine methods for scored prompts (``Sequence.scores_prompt``)."""

    def _score_prompts(self, batch: list[tuple[Sequence, list[int]]], scored: list[int], logits: Any) -> Any:
        """Every row's ``logits`` of a step (runner.step all_logits): each ``scored`` sequence's
        prompt rows become its prompt tokens' logprobs (the row at position p scores the token at
        p + 1; rows scored before a preemption are not scored again); returns each sequence's last
        row, as a step without all_logits would."""
        import torch

        from exl3tools.runtime import sampling

        ends = list(itertools.accumulate(len(c) for _, c in batch))
        for i in scored:
            seq, chunk = batch[i]
            lps, start = seq.prompt_lps, seq.num_cached
            if start == 0 and not lps:
                lps.append(_first(seq))
            j0, n = max(0, len(lps) - 1 - start), min(len(chunk), len(seq.prompt) - 1 - start)
            if j0 < n:
                r0, nxt = ends[i] - len(chunk), seq.prompt[start + j0 + 1:start + n + 1]
                got = sampling.logprobs_rows(logits[r0 + j0:r0 + n], nxt, seq.params.prompt_logprobs)
                lps.extend(TokenLogprob(t, lp, top) for t, (lp, top) in zip(nxt, got, strict=True))
        return logits.index_select(0, torch.tensor([e - 1 for e in ends], device=logits.device))

    def _end_prompt(self, seq: Sequence) -> None:
        """``seq``'s prompt is in the cache: send its prompt logprobs (echo) once, and end a
        max_tokens 0 choice (echo alone: the prompt scored, nothing generated)."""
        ev = None
        if seq.scores_prompt:
            ev = Event(seq.index, prompt_logprobs=seq.prompt_lps or [_first(seq)])
            seq.prompt_lps = None
        if seq.params.max_tokens == 0:
            ev = ev or Event(seq.index)
            ev.finish_reason = "length"
            seq.finished = True
        if ev is not None:
            seq.handle.push(ev)


def _first(seq: Sequence) -> TokenLogprob:
    """A prompt's first token: nothing before it, so no logprob and no alternatives."""
    return TokenLogprob(seq.prompt[0], None, None)
