"""The engine's speculative-decoding rounds (MTP, issue 14): which decoding rows draft this step, and
the draft / verify / accept / emit round for them. A mixin of server.engine.Engine (its runner,
samplers and per-sequence bookkeeping); the runner's side is runtime/speculative.py."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exl3tools.server.requests import Sequence

log = logging.getLogger("exl3tools.serve")


class SpeculativeRounds:
    """Engine methods for MTP speculative decoding (runtime.sampling.accept_drafts decides)."""

    def _spec_kw(self, seq: Sequence) -> dict:
        """add_sequence's ``speculative`` flag where the runner drafts: not for rows that need
        logprobs or processed logits (they decode one token at a time)."""
        if not getattr(self.runner, "spec_k", 0):
            return {}
        p = seq.params
        return {"speculative": not p.token_by_token}

    def _split_spec(self, batch: list[tuple[Sequence, list[int]]]) -> tuple[list, list[tuple[Sequence, int]]]:
        """(the rest, [(sequence, drafts)]): decoding rows the MTP head drafts for this step."""
        k = getattr(self.runner, "spec_k", 0)
        if not k:
            return batch, []
        rest, spec = [], []
        for seq, chunk in batch:
            p = seq.params
            room = min(p.max_tokens - len(seq.output_ids),
                       self.runner.max_context - len(seq.prompt) - len(seq.output_ids)) - 1
            if (len(chunk) == 1 and seq.output_ids and seq.pending == 1 and room >= 1
                    and not p.token_by_token):
                spec.append((seq, min(k, room)))
            else:
                rest.append((seq, chunk))
        return rest, spec

    def _spec_step(self, rows: list[tuple[Sequence, int]]) -> None:
        """Draft with the MTP head, verify all rows in one target forward, keep each row's accepted
        drafts and the token after them (runtime.sampling.accept_drafts), emit those tokens."""
        runner = self.runner
        self._ensure_generators([(0, seq) for seq, _ in rows], runner.model.embed.device)
        try:
            from exl3tools.runtime import sampling
            from exl3tools.runtime.speculative import Draw

            reqs = []
            for seq, k in rows:
                p = seq.params
                gen = seq.generator if p.temperature > 0 else None
                # greedy rows: None, the argmax of every such row at once; sampled ones: Draw
                # settings (the stock sampler), so that the depths chain on the device and the
                # host reads a round once (runtime/speculative.py), else a function a depth
                if p.temperature <= 0:
                    draw = None
                elif self._sample_fn is sampling.sample:
                    draw = Draw(p.temperature, p.top_k, p.top_p, gen)
                else:
                    draw = lambda r, p=p, gen=gen: self._sample_fn(r, p.temperature, p.top_k, p.top_p, gen)  # noqa: E731
                reqs.append((seq.seq_id, seq.output_ids[-1], k, draw))
            # draws on the device (greedy or Draw): the drafts stay on the device through the
            # verify, and the host reads them with the verdicts in one sync (else: drafts read,
            # then the verify)
            logits, drafted, preds, on_device = self._device_round(rows, reqs)   # on_device: accept takes the tokens
            if logits is None:
                # every row's drafts in one head forward per depth
                drafted = [(seq, d, q) for (seq, _), (d, q) in zip(rows, runner.draft_many(reqs), strict=True)]
                logits = runner.verify([(seq.seq_id, [seq.output_ids[-1]] + d) for seq, d, _ in drafted])
        except Exception:
            log.exception("speculative step failed")
            for seq, _ in rows:
                self._fail(seq)
            return
        self.steps += 1
        # the greedy rows' verdicts from one argmax over the whole verify (one host sync, not one a row)
        if preds is None and any(s.params.temperature <= 0 for s, _, _ in drafted):
            preds = logits.float().argmax(-1).tolist()
        row = 0
        # a device round's rows are K + 1 each, K its largest k (runtime/speculative.draft_device:
        # a row of a smaller k is padded; its verdict reads only its first k + 1 rows)
        width = max(len(d) for _, d, _ in drafted) + 1 if on_device else None
        for seq, drafts, qrows in drafted:
            p, k = seq.params, len(drafts)
            target = logits[row:row + k + 1]
            mine = None if preds is None or p.temperature > 0 else preds[row:row + k + 1]
            verified = [seq.output_ids[-1]] + drafts + [0] * (width - 1 - k) if on_device else None
            row += width or k + 1
            try:
                a, bonus = self._accept_fn(target, qrows, drafts, p.temperature, p.top_k, p.top_p,
                                           seq.generator if p.temperature > 0 else None, preds=mine)
                runner.accept(seq.seq_id, a + 1, tokens=verified)
                now = time.monotonic()      # the verdict is on the host: the verify has run
            except Exception:
                log.exception("accepting drafts failed")
                self._fail(seq)
                continue
            seq.num_cached += a + 1
            self.spec_drafted += k
            self.spec_accepted += a
            seq.handle.accepted_tokens += a
            seq.handle.rejected_tokens += k - a
            for j, tok in enumerate(drafts[:a] + [bonus]):
                if seq.finished:
                    break
                self._sample(seq, target[j], now, tok)

    def _device_round(self, rows: list[tuple[Sequence, int]], reqs: list) -> tuple:
        """(logits, drafted, preds, on_device) of a round whose drafts never reach the host before
        the verify (the runner's draft_device / verify_device: greedy or Draw-sampled rows, those
        of a smaller k padded to the largest; at TP > 1 too), the drafts and the verify's argmaxes
        read in one sync (on_device: accept takes the verified tokens); (None, None, None, False)
        where the runner cannot (then draft_many and verify)."""
        import torch

        runner = self.runner
        draft_device = getattr(runner, "draft_device", None)
        dd = draft_device(reqs) if draft_device is not None else None
        if dd is None:
            return None, None, None, False
        logits = runner.verify_device([(seq.seq_id, seq.output_ids[-1]) for seq, _ in rows], dd)
        n, k = dd.tokens.shape
        if logits is None:                      # rows past the fixed-shape step: read the drafts, verify
            flat = dd.tokens.reshape(-1).tolist()
        else:                                   # the drafts and the verify's argmaxes in one read
            flat = torch.cat([dd.tokens.reshape(-1), logits.float().argmax(-1)]).tolist()
        # each row's own drafts (len(q) of them: a row of a smaller k is padded to k)
        drafted = [(seq, flat[i * k:i * k + len(q)], q) for i, ((seq, _), q) in enumerate(zip(rows, dd.rows, strict=True))]
        if logits is None:
            return runner.verify([(seq.seq_id, [seq.output_ids[-1]] + d) for seq, d, _ in drafted]), drafted, None, False
        return logits, drafted, flat[n * k:], True
