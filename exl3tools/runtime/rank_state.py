"""What every rank of a Runner holds beside its model: the paged KV pool with the fixed-shape
decode step (PagedState), a sequence's MTP draft state (DraftState), and the row bookkeeping both
rank 0 (runtime/runner.py) and the workers (runtime/worker.py) use on a step's packed rows."""

from __future__ import annotations

import logging

import torch

from exl3tools.errors import UsageError
from exl3tools.plan import GRAPH_RESERVE
from exl3tools.runtime.model import CausalLM
from exl3tools.runtime.sampling import on_device

DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9   # the KV budget's share of the GPU (Runner, load_runner)

log = logging.getLogger("exl3tools.runtime")


def other_specialization(n: int) -> int:
    """A row count of the other Triton specialization than ``n`` (ints are compiled apart by
    whether they divide by 16, such as the routing kernel's pair count rows x (top_k + shared)):
    n - 1 for a multiple of 16, else the multiple of 16 below (0: none)."""
    return n - 1 if n % 16 == 0 else n - n % 16


def profile_forward(model: CausalLM, n: int, dtype: str = "float32", warm: bool | None = None) -> int:
    """One eager forward of ``n`` tokens through a throwaway paged pool (the path serve runs, so
    the measured activation peak is serve's: with the fused_eager preview through a throwaway
    decoder's glue, PagedDecoder.eager_body), and where long_steps is on (CUDA unless "0") the
    same tokens through that decoder's long step (PagedDecoder.long_step: serve's path for such
    steps then: with long-step graphs, the body of the bucket that holds ``n``); returns the pool's
    bytes (not activations). ``warm`` (default: on CUDA) runs both again at
    ``other_specialization(n)`` rows, the long step eagerly (the steps past the graphs' buckets
    take it; that bucket's body again would be the same shapes twice), so the Triton kernels of
    both row classes compile here, not in a served step (H100, 2026-12-07, EXL3TOOLS_PROMPT_FIT=0:
    a fresh server's first 869-row burst step took 419 ms before this warm-up, an 838-row one
    45 ms with it)."""
    from exl3tools.runtime import fused_step, preview
    from exl3tools.runtime.kv_pool import KVPool, PagedSeqView, layer_specs

    bs = DEFAULT_BLOCK_SIZE
    nb = -(-n // bs) + 1
    dev = model.embed.device
    pool = KVPool(layer_specs(model), nb, bs, getattr(torch, dtype), dev)
    table = list(range(1, nb))
    slots = pool.slots(table, n)
    d = None
    # a throwaway decoder only where it runs something: long steps are GQA models' (fused_step.supports)
    if preview.switched_on("fused_eager") or (preview.on_cuda("long_steps", dev) and fused_step.supports(model)):
        from exl3tools.errors import Exl3Error
        from exl3tools.runtime.paged_decode import PagedDecoder

        try:
            d = PagedDecoder(model, pool, 1, nb - 1)
        except Exl3Error:            # no fixed-shape step for this model: neither path
            d = None
    if d is not None and d.long_steps:
        d.set_blocks([(0, c, b) for c, b in enumerate(table)])
    other = other_specialization(n) if (dev.type == "cuda" if warm is None else warm) else 0
    for rows in (n, other) if other > 0 else (n,):
        tokens = [i % model.info.vocab_size for i in range(rows)]
        model.forward([(PagedSeqView(pool, slots, 0), tokens)], to_cpu=False,
                      body=d.eager_body if d is not None else None)
        if d is not None and d.long_steps:
            if rows != n:
                d.long_buckets = []      # the eager long step (see above)
            d.long_step(tokens, list(range(rows)), slots[:rows].tolist(), [0] * rows)
    return pool.nbytes()


def kv_budget_blocks(model: CausalLM, block_bytes: int, util: float, batched_tokens: int, dtype: str,
                     reserve: int = 0, graph_rows: int = 0) -> int:
    """The KV blocks this rank's GPU holds: ``util`` of the GPU, less what is in use (weights, the
    CUDA context, other processes), the activation peak of one eager step of ``batched_tokens``
    (measured), ``GRAPH_RESERVE`` and ``reserve`` bytes; below 2 when nothing is left. Every rank
    measures its own GPU (Runner takes the fewest over ranks: a worker's GPU may hold more)."""
    dev = model.embed.device
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    pool_bytes = profile_forward(model, int(batched_tokens), dtype)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base - pool_bytes
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    # prompt-step graphs keep their activations in the graph pool beside an eager step's
    # (estimated from the eager peak, doubled for what does not shrink with rows: decoded weights)
    graphs = int(peak * min(1.0, 2 * graph_rows / max(1, batched_tokens)))
    budget = int(util * total) - (total - free) - peak - GRAPH_RESERVE - reserve - graphs
    log.info("GPU memory (%s): %.2f GiB total, %.2f GiB in use after loading, activation peak %.2f GiB "
             "(%d tokens), KV budget %.2f GiB at --gpu-memory-utilization %.2f", dev, total / 2**30,
             (total - free) / 2**30, peak / 2**30, batched_tokens, max(budget, 0) / 2**30, util)
    return max(budget, 0) // block_bytes


class PagedState:
    """The tensors every rank holds for the paged cache: the KV pool and, where the model allows,
    the static decode step (runtime/paged_decode.py). Commands carry block tables and slots."""

    def __init__(self, model: CausalLM, *, num_blocks: int, block_size: int, dtype: str, max_seqs: int,
                 max_blocks: int, decode: str, mtp_paged: bool = False, max_rows: int | None = None,
                 prompt_rows: int | None = None, step_rows: int | None = None):
        from exl3tools.runtime.kv_pool import KVPool, layer_specs
        from exl3tools.runtime.paged_decode import PagedDecoder

        self.model = model
        if model.head_sharded:     # gathered here, in lockstep, before a step can be captured
            model.head_widths(model.head.out_real)
        self.pool = KVPool(layer_specs(model), num_blocks, block_size, getattr(torch, dtype), model.embed.device)
        # the MTP head's one layer, in blocks addressed like the pool's (the sequence's own table)
        self.head_pool = None
        if mtp_paged and getattr(model, "mtp", None) is not None:
            self.head_pool = KVPool([tuple(model.mtp.block.attn.cache_spec())], num_blocks, block_size,
                                    getattr(torch, dtype), model.embed.device)
        self.decoder = None
        if decode in ("static", "graphs"):
            self.decoder = PagedDecoder(model, self.pool, max_seqs, max_blocks, graphs=decode == "graphs",
                                        head_pool=self.head_pool, max_rows=max_rows, prompt_rows=prompt_rows,
                                        step_rows=step_rows)

    def nbytes(self) -> int:
        """The KV pool's bytes, the MTP head's blocks included."""
        return self.pool.nbytes() + (self.head_pool.nbytes() if self.head_pool is not None else 0)

    def forward(self, items: list[tuple[list[int], int, list[int]]], *, all_logits: bool = False,
                states: bool = False):
        """Eager forward; each item is (block table, tokens cached, new tokens). Device logits
        (with ``states``: and the final-normed states of every new row, CausalLM.forward)."""
        views = paged_views(self.pool, items)
        body = self.decoder.eager_body if self.decoder is not None else None
        return self.model.forward(list(zip(views, (t for _, _, t in items), strict=True)), all_logits=all_logits,
                                  to_cpu=False, states=states, body=body)

    def decode(self, tokens, positions, slots, rows, updates, device_tokens=None, states: bool = False,
               long: bool = False):
        """The fixed-shape step over rows (PagedDecoder.step), or with ``long`` its eager long step
        (PagedDecoder.long_step: each sequence's last row's logits); with ``states``: (logits, states)."""
        self.decoder.set_blocks(updates)
        if long:
            logits, hn = self.decoder.long_step(tokens, positions, slots, rows)
            return (logits, hn) if states else logits
        logits = self.decoder.step(tokens, positions, slots, rows, device_tokens)
        return (logits, self.decoder.states[:len(rows)]) if states else logits


def run_head(paged: PagedState, mode: str, payload, states: list[torch.Tensor],
             device_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP head over rows whose cache is ``paged.head_pool`` (every rank runs the same call):
    ``mode`` "static": ``payload`` is ((tokens, positions, slots, rows, updates) of the decode
    step, rows per sequence) and the decoder's draft step runs; "eager": ``payload`` is [(block
    table, first position, tokens)] per sequence and the head runs over paged views. Each
    sequence's newest (normed state, logits) row, in order. ``device_tokens`` ("static" only):
    the rows' tokens on the device (PagedDecoder.draft's)."""
    import itertools

    if mode == "static":
        (tokens, positions, slots, rows, updates), counts = payload
        paged.decoder.set_blocks(updates)
        g, dl = paged.decoder.draft(tokens, positions, slots, rows, torch.cat(states), device_tokens)
        if all(c == 1 for c in counts):      # one row a sequence (deeper drafts): no index to copy up
            return g[:len(counts)].clone(), dl[:len(counts)].clone()
        ends = on_device([e - 1 for e in itertools.accumulate(counts)], g.device)   # no stream sync
        return g[ends], dl[ends]
    return paged.model.mtp.forward_many(paged_views(paged.head_pool, payload), states, [t for _, _, t in payload])


def paged_views(pool, items: list[tuple[list[int], int, list[int]]]) -> list:
    """A PagedSeqView over ``pool`` per (block table, tokens cached, new tokens) item: the eager
    forward's caches for one step."""
    from exl3tools.runtime.kv_pool import PagedSeqView

    return [PagedSeqView(pool, pool.slots(list(table), n0 + len(toks)), n0) for table, n0, toks in items]


def split_rows(tokens: list[int], counts: list[int]) -> list[tuple]:
    """Flat decode-step tokens back into wire-like items ((), 0, tokens) per sequence."""
    out, i = [], 0
    for n in counts:
        out.append(((), 0, tokens[i:i + n]))
        i += n
    return out


def rows_of(hn: torch.Tensor, wire) -> tuple[torch.Tensor, ...]:
    """A packed forward's per-row states split by sequence (``wire`` items end with their tokens)."""
    return hn.split([len(item[-1]) for item in wire])


class DraftState:
    """A sequence's MTP draft state: the head's own cache (one layer, outside the block pool; with
    mtp_paged, the default, only its ``length`` in the sequence's blocks) and the (target state at
    position i, token at i + 1) pairs it has not read yet. ``states`` holds one row more than
    ``tokens``: the newest state waits for the token sampled after it."""

    __slots__ = ("cache", "length", "states", "tokens")

    def __init__(self, head, paged_start: int | None = None):
        # paged (PagedState.head_pool): no cache of its own, only how many positions of the
        # sequence's blocks hold the head's entries; a prefix hit's blocks carry theirs
        self.cache = head.new_cache() if paged_start is None else None
        self.length = 0 if paged_start is None else int(paged_start)
        self.states: list[torch.Tensor] = []
        self.tokens: list[int] = []

    def extend(self, states: torch.Tensor, tokens: list[int]) -> None:
        """The target computed ``tokens`` (at consecutive positions) with these final states."""
        # the first token pairs with the state before it; with no state yet (a prompt's first
        # computed token, after cached prefix blocks too) it has none and is skipped
        self.tokens.extend(tokens if self.states else tokens[1:])
        self.states.append(states)

    def take_known(self) -> tuple[torch.Tensor, list[int]] | None:
        """The pending pairs whose token is known (every state but the newest), removed; the newest
        state stays pending for the token sampled after it. None: no such pair."""
        if not self.tokens:
            return None
        n = len(self.tokens)
        states, tokens = torch.cat(self.states), self.tokens
        self.states, self.tokens = [states[n:]], []
        return states[:n], tokens

    def take(self, token: int) -> tuple[torch.Tensor, list[int]]:
        """All pending pairs, ``token`` completing the newest; the pending lists are emptied."""
        if not self.states:
            raise UsageError("no target state to draft from: the sequence has computed no token yet")
        states, tokens = torch.cat(self.states), self.tokens + [token]
        self.states, self.tokens = [], []
        return states, tokens
