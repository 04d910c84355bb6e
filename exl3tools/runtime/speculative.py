"""The Runner's speculative-decoding steps (MTP, issue 14): draft with the checkpoint's MTP head,
verify every row's drafts in one target forward over the paged cache, keep an accepted prefix.

A mixin of runtime.runner.Runner (its sequences, blocks, paged state and rank commands); the
workers' side of the same steps is runtime.worker.WorkerDrafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch

from exl3tools.errors import RuntimeFailure, UsageError
from exl3tools.runtime import preview, sampling
from exl3tools.runtime.rank_state import rows_of, run_head


@dataclass(frozen=True, slots=True)
class Draw:
    """A draft depth's sampled draw (temperature > 0) as settings, not a function, so that chained
    rounds draw it on the device (sampling.sample_batch_device: the same token and generator use
    as sampling.sample row by row); called on a row it draws on the host like ``sample``."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None

    def __call__(self, row: torch.Tensor) -> int:
        return sampling.sample(row, self.temperature, self.top_k, self.top_p, self.generator)


class SpeculativeSteps:
    """Runner methods for MTP speculative decoding (the engine accepts or rejects the drafts)."""

    def draft(self, seq_id: Hashable, last_token: int, k: int, draw) -> tuple[list[int], list[torch.Tensor]]:
        """``k`` draft tokens after ``last_token`` (the sequence's newest token, not in the cache
        yet) from the MTP head: ``draw(logits row) -> token`` picks each (None: the row's argmax,
        taken for every such row of a depth at once: one host sync, not one a row); returns the drafts and
        the head's logits rows they were drawn from (device). The head's cache keeps only the
        exact (state, token) pairs."""
        return self.draft_many([(seq_id, last_token, k, draw)])[0]

    def draft_many(self, reqs: list[tuple[Hashable, int, int, Any]]) -> list[tuple[list[int], list[torch.Tensor]]]:
        """``draft`` for several sequences, (seq_id, last_token, k, draw) each: one head forward
        per draft depth over every sequence that still drafts (8 streams: 8x fewer launches)."""
        from exl3tools.runtime.mtp import truncate

        specs = []
        for seq_id, _, k, _ in reqs:
            sp = self._seq(seq_id).spec
            if sp is None:
                raise UsageError(f"sequence {seq_id!r} has no draft state")
            if k < 1:
                raise UsageError(f"sequence {seq_id!r}: at least one draft token, not {k}")
            specs.append(sp)
        if not reqs:
            return []
        if self.paged.head_pool is not None:
            return self._draft_paged(reqs, specs)
        head = self.model.mtp
        taken = [sp.take(int(last)) for sp, (_, last, _, _) in zip(specs, reqs, strict=True)]
        # the other ranks run their head part in step (the same sequences in the same order)
        self._send(("draft", [(s, int(last)) for s, last, _, _ in reqs]))
        g, dl = head.forward_many([sp.cache for sp in specs], [st for st, _ in taken], [t for _, t in taken])
        committed = [sp.cache.length for sp in specs]     # g, dl: each sequence's newest row

        def deeper(live, gs, toks):
            self._send(("draft_next", [(reqs[i][0], t) for i, t in zip(live, toks, strict=True)]))
            return head.forward_many([specs[i].cache for i in live], gs, [[t] for t in toks])

        out = _draw_depths(reqs, g, dl, deeper)
        self._send(("draft_end", [s for s, *_ in reqs]))
        for sp, n in zip(specs, committed, strict=True):
            truncate(sp.cache, n)
        return out

    def draft_device(self, reqs: list[tuple[Hashable, int, int, Any]]) -> DeviceDrafts | None:
        """``draft_many`` with the drafts left on the device (``DeviceDrafts``: ``verify_device``
        reads them there, and the caller reads them with its verdicts in one sync; at TP > 1 the
        workers get each depth's tokens by a device broadcast). Requests of a smaller k than the
        round's largest (K) draft their own k, padded with token 0 to K: their verify writes K + 1
        slots, of which ``accept`` keeps at most k + 1, so the round stays on the device when one
        sequence nears its max_tokens. None where the drafts cannot stay (draws that are host
        functions, the head's own cache, rows past the fixed-shape step, a padded row past
        max_context or the free blocks): call draft_many."""
        if not reqs or self.paged.head_pool is None:
            return None
        specs = []
        for seq_id, _, k, _ in reqs:
            sp = self._seq(seq_id).spec
            if sp is None or k < 1:
                return None
            specs.append(sp)
        K = max(k for _, _, k, _ in reqs)
        if not self._chains(reqs):
            return None
        if any(k < K for _, _, k, _ in reqs):      # the padded verify must fit where the real one would
            if any(self.blocks.length(s) + K + 1 > self.max_context for s, *_ in reqs):
                return None
            if not self.fits([(s, K + 1) for s, *_ in reqs]):
                return None
        return self._draft_paged(reqs, specs, keep_on_device=True)

    def _chains(self, reqs: list) -> bool:
        """Whether ``reqs``' deeper drafts chain on the device (_chain_depths): greedy draws (None)
        and ``Draw`` settings, not host functions."""
        d = self.paged.decoder
        return (all(draw is None or isinstance(draw, Draw) for *_, draw in reqs) and d is not None
                and len(reqs) <= d.max_rows and preview.switched_on("chained_drafts"))

    def _draft_paged(self, reqs: list, specs: list, keep_on_device: bool = False):
        """draft_many with the head's cache in ``paged.head_pool``: the pair (state p, token p + 1)
        sits at position p's slot of the sequence's own blocks. Rows that fit the decoder's
        ``max_rows`` (``--max-num-seqs`` x (1 + k)) run its fixed-shape draft step (a graph replay
        on CUDA), others the eager head over paged views. Deeper drafts write past the cache, into
        slots reserved now (verify reserves the same ones again, accept gives back what it does not
        keep)."""
        for s, _, k, _ in reqs:
            if k > 1:
                self.blocks.reserve(s, k - 1)

        def run(rows: list[tuple[Hashable, list[int], int]], states: list[torch.Tensor], lasts=None,
                device_tokens: torch.Tensor | None = None):
            """(seq, tokens, first position) per sequence -> each one's newest (state, logits) row;
            the other ranks run the same (``lasts``: the first depth's last tokens, which they take
            their pending pairs with; deeper: they feed their own rows of the depth before).
            ``device_tokens``: the fixed-shape step only, the rows' tokens on the device (``rows``
            then hold placeholders; the workers get them by a broadcast, Runner._share)."""
            d = self.paged.decoder
            if d is not None and sum(len(t) for _, t, _ in rows) <= d.max_rows:
                slots = [self.blocks.slots(s, n0, len(t)) for s, t, n0 in rows]
                args = self._decode_args([(s, self._seq(s), t, n0) for s, t, n0 in rows], slots)
                mode, payload = "static", (args, [len(t) for _, t, _ in rows])
            else:
                mode, payload = "eager", [(list(self.blocks.table(s)), n0, t) for s, t, n0 in rows]
            self._send(("hdraft", lasts, [s for s, _, _ in rows], mode, payload, device_tokens is not None))
            if device_tokens is not None:
                device_tokens = self._share(device_tokens)
            return run_head(self.paged, mode, payload, states, device_tokens)

        taken = [sp.take(int(last)) for sp, (_, last, _, _) in zip(specs, reqs, strict=True)]
        g, dl = run([(s, t, sp.length) for (s, *_), sp, (_, t) in zip(reqs, specs, taken, strict=True)],
                    [st for st, _ in taken], lasts=[int(last) for _, last, _, _ in reqs])
        for sp, (_, t) in zip(specs, taken, strict=True):
            sp.length += len(t)                  # exact pairs: kept; deeper drafts are not
        nxt = [sp.length for sp in specs]        # where each sequence's next deeper draft goes

        def deeper(live, gs, toks):
            res = run([(reqs[i][0], [t], nxt[i]) for i, t in zip(live, toks, strict=True)], gs)
            for i in live:
                nxt[i] += 1
            return res

        # greedy and Draw-sampled drafts through the fixed-shape step (any TP): each depth takes
        # the tokens of the one before on the device, and the host reads every depth's drafts once at
        # the end (EXL3TOOLS_CHAINED_DRAFTS=0: a sync a depth), or never (keep_on_device)
        if self._chains(reqs):
            def deeper_device(live, gs, toks):
                res = run([(reqs[i][0], [0], nxt[i]) for i in live], gs, device_tokens=toks)
                for i in live:
                    nxt[i] += 1
                return res
            return _chain_depths(reqs, g, dl, deeper_device, read=not keep_on_device)
        return _draw_depths(reqs, g, dl, deeper)

    def _catch_up(self, seq_ids: list[Hashable]) -> None:
        """Feed the MTP head the known pairs of these sequences now (after a prompt chunk's eager
        forward), one eager head pass each, so a long prompt's pairs go through the head chunk by
        chunk during its prefill rather than all at its first draft: there a 30000-token prompt's
        pairs took seconds after the first token (H200, GLM-5 shape, --speculative-tokens 1: one
        stream at a 30000-token context decoded 27 tok/s, 122 at 4096). The other ranks take the
        same pairs from their own states ("hcatch")."""
        todo = []
        for s in seq_ids:
            sp = self._seq(s).spec
            known = sp.take_known() if sp is not None else None
            if known is not None:
                todo.append((s, sp, *known))
        if not todo:
            return
        if self.paged.head_pool is not None:       # the head's entries in the sequence's own blocks
            payload = [(list(self.blocks.table(s)), sp.length, t) for s, sp, _, t in todo]
            self._send(("hcatch", [s for s, *_ in todo], payload))
            run_head(self.paged, "eager", payload, [st for _, _, st, _ in todo])
            for _, sp, _, t in todo:
                sp.length += len(t)
        else:
            self._send(("hcatch", [s for s, *_ in todo], None))
            self.model.mtp.forward_many([sp.cache for _, sp, _, _ in todo], [st for _, _, st, _ in todo],
                                        [t for *_, t in todo])

    def verify(self, batch: list[tuple[Hashable, list[int]]]) -> torch.Tensor:
        """One target forward over each sequence's ``[last token] + drafts`` (device logits of
        every row, float32). Nothing is committed: ``accept`` keeps a prefix and gives back the
        rest."""
        if self._closed:
            raise RuntimeFailure("runner is closed")
        items = []
        for s, toks in batch:
            seq = self._seq(s)
            if seq.spec is None or seq.pending is not None or seq.unknown:
                raise UsageError(f"sequence {s!r} cannot take a verify step now")
            items.append((s, seq, [int(t) for t in toks], self._length_before(s, len(toks))))
        self._check_room([(s, len(t)) for s, _, t, _ in items])
        slots = [self.blocks.reserve(s, len(t)) for s, _, t, _ in items]
        wire = [(list(self.blocks.table(s)), n0, t) for s, _, t, n0 in items]
        try:
            if self._step_path(items, all_logits=True) == "decode":     # [last] + drafts of every row: one replay
                args = self._decode_args(items, slots)
                self._send(("pverify", wire, [s for s, *_ in items], args))
                logits, hn = self.paged.decode(*args, states=True)
                logits, hn = logits.clone(), hn.clone()
            else:
                self._send(("pverify", wire, [s for s, *_ in items], None))
                logits, hn = self.paged.forward(wire, all_logits=True, states=True)
        except BaseException:
            for s, *_ in items:
                self.blocks.trim(s)
            raise
        for (_, seq, t, _), states in zip(items, rows_of(hn, wire), strict=True):
            seq.pending = (t, states)
        return logits

    def verify_device(self, lasts: list[tuple[Hashable, int]], drafts: DeviceDrafts) -> torch.Tensor | None:
        """``verify`` of each sequence's ``[last token] + drafts`` with the drafts still on the device
        (``draft_device``'s): the step takes them as device tokens, so nothing is read back before
        it. ``accept`` then needs the verified tokens (``tokens=``). None where the rows do not fit
        the fixed-shape step (call ``verify`` with the drafts read)."""
        if self._closed:
            raise RuntimeFailure("runner is closed")
        n, k = drafts.tokens.shape
        items = []
        for s, last in lasts:
            seq = self._seq(s)
            if seq.spec is None or seq.pending is not None or seq.unknown:
                raise UsageError(f"sequence {s!r} cannot take a verify step now")
            items.append((s, seq, [int(last)] + [0] * k, self._length_before(s, k + 1)))
        if len(items) != n or self._step_path(items, all_logits=True) != "decode":
            return None
        self._check_room([(s, k + 1) for s, *_ in items])
        slots = [self.blocks.reserve(s, k + 1) for s, *_ in items]
        head = torch.tensor([last for _, last in lasts], dtype=torch.int64)
        dev = drafts.tokens.device
        head = (head.pin_memory() if drafts.tokens.is_cuda else head).to(dev, non_blocking=True)
        tokens = torch.cat([head[:, None], drafts.tokens], dim=1).reshape(-1)
        wire = [(None, n0, t) for _, _, t, n0 in items]
        try:
            args = self._decode_args(items, slots)
            self._send(("pverify", wire, [s for s, *_ in items], args, True))
            logits, hn = self.paged.decode(*args, self._share(tokens), states=True)
            logits, hn = logits.clone(), hn.clone()
        except BaseException:
            for s, *_ in items:
                self.blocks.trim(s)
            raise
        for (_, seq, _, _), states in zip(items, rows_of(hn, wire), strict=True):
            seq.pending = (None, states)        # the tokens: accept's, once read
        return logits

    def accept(self, seq_id: Hashable, n: int, tokens: list[int] | None = None) -> None:
        """Keep the first ``n`` (>= 1) tokens of the last ``verify`` of ``seq_id`` in its cache;
        the rest of the written slots are given back (blocks past the new length freed).
        ``tokens``: the verified tokens, after a ``verify_device`` (whose drafts stayed on the device)."""
        seq = self._seq(seq_id)
        toks, states = seq.pending
        if toks is None:
            if tokens is None or len(tokens) != len(states):
                raise UsageError("accept after verify_device needs the verified tokens")
            toks = [int(t) for t in tokens]
        if not 1 <= n <= len(toks):
            raise UsageError(f"accept {n} of {len(toks)} verified tokens")
        seq.pending = None
        self._send(("accept", seq_id, int(n), toks[:n]))
        seq.tokens.extend(toks[:n])
        self.blocks.commit(seq_id, seq.tokens)
        self.blocks.trim(seq_id)
        seq.spec.extend(states[:n], toks[:n])


@dataclass(frozen=True, slots=True)
class DeviceDrafts:
    """Drafts left on the device (``SpeculativeSteps.draft_device``): ``tokens`` (n, K) int64, row
    i sequence i's drafts, padded with token 0 past its own k; ``rows[i]``: the head's logits rows
    its k drafts were drawn from (so k = len(rows[i]))."""

    tokens: torch.Tensor
    rows: list[list[torch.Tensor]]


def _chain_depths(reqs: list, g: torch.Tensor, dl: torch.Tensor, deeper, read: bool = True):
    """``_draw_depths`` without a host sync between depths, for greedy requests and ``Draw``
    settings: each depth's tokens (argmaxes, or draws by sampling.sample_batch_device) stay on
    the device and feed ``deeper(live, state rows, device tokens)``; every depth's tokens reach
    the host in one read at the end, or (``read`` False; a request of a smaller k padded) stay on
    the device as ``DeviceDrafts``."""
    rows: list[list[torch.Tensor]] = [[] for _ in reqs]
    picks: list[tuple[list[int], torch.Tensor]] = []       # (live request indices, their tokens)
    live = list(range(len(reqs)))
    while True:
        draws = [reqs[i][3] for i in live]
        if all(d is None for d in draws):
            toks = dl.float().argmax(-1)
        else:   # a row that cannot be sampled (NaN) drafts token 0: its verify rejects it
            toks = sampling.sample_batch_device(
                dl, [0.0 if d is None else d.temperature for d in draws], [0 if d is None else d.top_k for d in draws],
                [1.0 if d is None else d.top_p for d in draws], [None if d is None else d.generator for d in draws],
            ).clamp(min=0)
        picks.append((live, toks))
        for j, i in enumerate(live):
            rows[i].append(dl[j])
        keep = [j for j, i in enumerate(live) if len(rows[i]) < reqs[i][2]]
        if not keep:
            break
        idx = None
        if len(keep) < len(live):          # some requests drafted all theirs: a pinned index (no stream sync)
            idx = torch.tensor(keep, dtype=torch.int64)
            idx = (idx.pin_memory() if toks.is_cuda else idx).to(toks.device, non_blocking=True)
        live = [live[j] for j in keep]
        g, dl = deeper(live, [g[j:j + 1] for j in keep], toks if idx is None else toks.index_select(0, idx))
    if not read:
        K = len(picks)
        if all(len(lv) == len(reqs) for lv, _ in picks):
            return DeviceDrafts(torch.stack([t for _, t in picks], dim=1), rows)
        out = torch.zeros(len(reqs), K, dtype=torch.int64, device=picks[0][1].device)   # padding: token 0
        for d, (lv, t) in enumerate(picks):
            if len(lv) == len(reqs):
                out[:, d] = t
            else:   # the rows still drafting at depth d: a pinned index, no stream sync
                idx = torch.tensor(lv, dtype=torch.int64)
                idx = (idx.pin_memory() if t.is_cuda else idx).to(t.device, non_blocking=True)
                out[:, d].index_copy_(0, idx, t.long())
        return DeviceDrafts(out, rows)
    drafts: list[list[int]] = [[] for _ in reqs]
    flat = torch.cat([t for _, t in picks]).tolist()           # the one host read
    at = 0
    for lv, _ in picks:
        for i, v in zip(lv, flat[at:at + len(lv)], strict=True):
            drafts[i].append(v)
        at += len(lv)
    return [(d, r) for d, r in zip(drafts, rows, strict=True)]


def _draw_depths(reqs: list, g: torch.Tensor, dl: torch.Tensor, deeper) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Each request's drafts, depth by depth, from the head's first rows (g, dl: one per request):
    its ``draw`` picks a token from its logits row (None: the argmax, all such rows in one sync);
    ``deeper(live, state rows, tokens)`` runs the
    head once more for the requests still drafting (indices into ``reqs``) and returns (g, dl)."""
    out: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in reqs]
    live = list(range(len(reqs)))
    while True:
        greedy = [j for j, i in enumerate(live) if reqs[i][3] is None]      # draw None: the argmax
        picks = dict(zip(greedy, dl[greedy].float().argmax(-1).tolist(), strict=True)) if greedy else {}
        for j, i in enumerate(live):
            out[i][1].append(dl[j])
            out[i][0].append(picks[j] if j in picks else int(reqs[i][3](dl[j])))
        keep = [j for j, i in enumerate(live) if len(out[i][0]) < reqs[i][2]]
        if not keep:
            return out
        live = [live[j] for j in keep]
        g, dl = deeper(live, [g[j:j + 1] for j in keep], [out[i][0][-1] for i in live])
