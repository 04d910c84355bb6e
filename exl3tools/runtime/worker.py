"""A tensor-parallel worker (rank > 0): it loads its part of the model, then runs rank 0's
commands (eager steps, decode steps, MTP drafts) in lockstep until "stop". Rank 0's side is
runtime/runner.Runner; distributed.py starts the workers."""

from __future__ import annotations

import torch

from exl3tools.errors import Exl3Error
from exl3tools.runtime import distributed as D
from exl3tools.runtime.loader import resolve
from exl3tools.runtime.model import CausalLM
from exl3tools.runtime.rank_model import build_local_model, rank_device
from exl3tools.runtime.rank_state import (
    DraftState,
    PagedState,
    kv_budget_blocks,
    rows_of,
    run_head,
    split_rows,
)


def serve_rank(path: str, *, rank: int, world: int, port: int | None, backend: str = "reference",
               device: str = "cpu", max_context: int | None = None, moe: str = "tp", trace: bool = False) -> None:
    """Run rank ``rank`` (> 0): load, report, then execute rank 0's commands until 'stop'.

    Rank 0 owns the block manager; a worker keeps only its own KV pool (same blocks, its heads)
    and follows the block tables and slots each command carries."""
    device = rank_device(device, rank, world)   # before the group: NCCL binds the current device
    D.init_group(rank, world, device, port)
    try:
        if trace:
            D.trace_opens_start()
        err, model = None, None
        try:
            model = build_local_model(resolve(path, world), rank, world, backend=backend, device=device,
                                      max_context=max_context, moe=moe)
        except Exl3Error as exc:
            err = exc
        D.exchange_status(err, D.trace_opens_stop() if trace else None)
        paged: PagedState | None = None
        drafts = WorkerDrafts(model)
        while True:
            cmd = D.broadcast()
            op = cmd[0]
            if op == "pstep":
                if len(cmd) > 3 and any(s is not None for s in cmd[3]):   # rows with draft state
                    _, hn = paged.forward(cmd[1], all_logits=cmd[2], states=True)
                    drafts.extend(cmd[1], cmd[3], hn)
                else:
                    paged.forward(cmd[1], all_logits=cmd[2])
            elif op in WorkerDrafts.OPS:
                drafts.run(paged, cmd)
            elif op == "pdecode":
                args, spec = cmd[1:6], cmd[6] if len(cmd) > 6 else None
                long = len(cmd) > 8 and cmd[8]  # rank 0's long step (PagedDecoder.long_step)
                if len(cmd) > 7 and cmd[7]:     # a chained step: its tokens come from rank 0's device
                    paged.decode(*args, receive(paged, len(args[0])))
                elif spec is not None and any(sid is not None for sid, _ in spec):
                    _, hn = paged.decode(*args, states=True, long=long)
                    drafts.extend(split_rows(args[0], [n for _, n in spec]), [sid for sid, _ in spec], hn)
                else:
                    paged.decode(*args, long=long)
            elif op == "kv_init":
                paged = PagedState(model, **cmd[1])
            elif op == "capture":
                paged.decoder.capture()
            elif op == "kv_budget":     # this GPU's blocks; rank 0 takes the fewest (Runner._budget_blocks)
                D.gather_ints(kv_budget_blocks(model, *cmd[1:]))
            elif op == "stop":
                break
    finally:
        D.destroy()


def receive(paged: PagedState, n: int) -> torch.Tensor:
    """The ``n`` device tokens rank 0 shares after a command (Runner._share)."""
    return D.broadcast_tensor(torch.empty(n, dtype=torch.long, device=paged.model.embed.device))


class WorkerDrafts:
    """A worker rank's side of speculative decoding (rank 0's Runner.draft/verify/accept): its own
    part of the MTP head runs in lockstep (the head's collectives), so it keeps the same draft
    state per sequence, fed from its own copy of the target's final states."""

    OPS = ("draft", "draft_next", "draft_end", "hdraft", "hcatch", "pverify", "accept", "sfree")

    def __init__(self, model: CausalLM):
        self.model = model
        self.specs: dict = {}
        self.pending: dict = {}
        self.drafting: dict = {}

    def _spec(self, sid) -> DraftState:
        sp = self.specs.get(sid)
        if sp is None:
            sp = self.specs[sid] = DraftState(self.model.mtp)
        return sp

    def extend(self, wire, sids, hn: torch.Tensor) -> None:
        for (_, _, toks), sid, states in zip(wire, sids, rows_of(hn, wire), strict=True):
            if sid is not None:
                self._spec(sid).extend(states, toks)

    def run(self, paged: PagedState, cmd) -> None:
        from exl3tools.runtime.mtp import truncate

        op, head = cmd[0], self.model.mtp
        if op == "draft":           # [(seq, last token)]: rank 0's Runner.draft_many, the same order
            sps = [self._spec(s) for s, _ in cmd[1]]
            taken = [sp.take(t) for sp, (_, t) in zip(sps, cmd[1], strict=True)]
            g, _ = head.forward_many([sp.cache for sp in sps], [st for st, _ in taken], [t for _, t in taken])
            for j, ((s, _), sp) in enumerate(zip(cmd[1], sps, strict=True)):
                self.drafting[s] = (g[j:j + 1], sp.cache.length)
        elif op == "draft_next":    # [(seq, its newest draft)]: the sequences still drafting
            sids = [s for s, _ in cmd[1]]
            g, _ = head.forward_many([self.specs[s].cache for s in sids], [self.drafting[s][0] for s in sids],
                                     [[t] for _, t in cmd[1]])
            for j, s in enumerate(sids):
                self.drafting[s] = (g[j:j + 1], self.drafting[s][1])
        elif op == "draft_end":
            for s in cmd[1]:
                _, committed = self.drafting.pop(s)
                truncate(self.specs[s].cache, committed)
        elif op == "hdraft":        # the head's cache in blocks: rank 0's SpeculativeSteps._draft_paged
            lasts, sids, mode, payload = cmd[1:5]
            if lasts is not None:   # the first depth: every pending pair
                states = [st for st, _ in (self._spec(s).take(t) for s, t in zip(sids, lasts, strict=True))]
            else:
                states = [self.drafting[s] for s in sids]
            # a chained depth: its tokens (the depth before's draws) come from rank 0's device
            tokens = receive(paged, len(payload[0][0])) if len(cmd) > 5 and cmd[5] else None
            g, _ = run_head(paged, mode, payload, states, tokens)
            self.drafting = {s: g[j:j + 1] for j, s in enumerate(sids)}
        elif op == "hcatch":        # a prompt chunk's known pairs: rank 0's SpeculativeSteps._catch_up
            sids, payload = cmd[1:]
            known = [self._spec(s).take_known() for s in sids]
            if payload is not None:
                run_head(paged, "eager", payload, [st for st, _ in known])
            else:
                head.forward_many([self.specs[s].cache for s in sids], [st for st, _ in known], [t for _, t in known])
        elif op == "pverify":
            if len(cmd) > 4 and cmd[4]:     # verify_device: the drafts come from rank 0's device
                _, hn = paged.decode(*cmd[3], receive(paged, len(cmd[3][0])), states=True)
            elif len(cmd) > 3 and cmd[3] is not None:          # rank 0 verified through the decode step
                _, hn = paged.decode(*cmd[3], states=True)
            else:
                _, hn = paged.forward(cmd[1], all_logits=True, states=True)
            for (_, _, toks), sid, states in zip(cmd[1], cmd[2], rows_of(hn, cmd[1]), strict=True):
                self.pending[sid] = (toks, states)
        elif op == "accept":        # (seq, n, the n kept tokens: after verify_device only rank 0 knew them)
            toks, states = self.pending.pop(cmd[1])
            self._spec(cmd[1]).extend(states[:cmd[2]], cmd[3] if len(cmd) > 3 else toks[:cmd[2]])
        elif op == "sfree":
            for d in (self.specs, self.pending, self.drafting):
                d.pop(cmd[1], None)
