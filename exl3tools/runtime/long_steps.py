"""The paged decoder's long steps (a mixin of runtime/paged_decode.PagedDecoder): a step past the
prompt buckets (a long prompt chunk alone or beside decoding rows) through the fused step's glue
once, each sequence's rows attending causally over its blocks in one pass of the paged prefill
kernel (``long_step``; GQA models, on CUDA unless EXL3TOOLS_LONG_STEPS=0). On CUDA (unless
EXL3TOOLS_LONG_GRAPHS=0) such a step of up to a LONG_GRAPH_ROWS bucket and LONG_GRAPH_SEQS sequences
is padded to its bucket and replayed as a CUDA graph, the prefill kernel on a fixed grid of row tiles.

The mixin reads the decoder's state: ``model``, ``pool``, ``tables``, ``device``, ``max_blocks``,
``graphs`` and its graph store (``_graphs``, ``_pools``, ``_capture_keys``), ``_fused``, its
``prompt_rows`` and ``step_rows``, and the ``long_steps``, ``long_buckets``, ``long_seqs`` and
``_long`` that its constructor sets."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from exl3tools.errors import UsageError
from exl3tools.runtime import preview, sampling
from exl3tools.runtime.block_manager import SCRATCH_BLOCK

if TYPE_CHECKING:
    from exl3tools.runtime.model import CausalLM

log = logging.getLogger("exl3tools.runtime")

# the long-step graphs' buckets (those past the prompt buckets): every 128 rows, so a step is padded
# by at most 127 rows (~2 ms of GPU time near 2048 rows on an H100, about what a graph saves in
# launches on a fast host; 20-60 ms on a slow one). Their activations share one graph pool
LONG_GRAPH_ROWS = tuple(range(640, 2049, 128))
# and one that fits the largest planned step where that is past them (rounded up to LONG_GRAPH_ALIGN
# rows, up to LONG_GRAPH_MAX_ROWS): a 2048-token chunk beside decoding rows, the usual long step of
# a busy server, would otherwise take the eager long step
LONG_GRAPH_ALIGN, LONG_GRAPH_MAX_ROWS = 64, 4352
# sequences a long-step graph takes (a step of more: the eager long step): a long prompt chunk
# beside every decoding sequence of a default server (64); each costs a padded row of logits
LONG_GRAPH_SEQS = 64


class LongSteps:
    """PagedDecoder's long steps: the eager form and the padded, graphed one (long_graphs)."""

    def _init_long(self) -> None:
        """The long-step graphs' state, once ``long_steps``, ``prompt_rows`` and ``step_rows`` are
        set: their buckets (on CUDA unless EXL3TOOLS_LONG_GRAPHS=0, elsewhere only with "1"), the
        sequences a graph takes, by bucket its packed inputs, and the outputs every bucket writes.
        Padded and replayed as a graph, a long step costs the GPU's time, not the host's ~180 launches a
        layer (a slow host took 55-100 ms for a 2048-token air6 step that another did in 33; H100,
        2026-12-07 08:02)."""
        self.long_seqs = min(self.max_seqs, LONG_GRAPH_SEQS)
        on = self.long_steps and preview.on_cuda("long_graphs", self.device)
        self.long_buckets = long_buckets(self.prompt_rows, self.step_rows) if on else []
        self._long: dict[int, torch.Tensor] = {}
        self._long_out: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.inference_mode()
    def long_step(self, tokens: list[int], positions: list[int], slots: list[int],
                  rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of any number of rows, laid out as ``step`` takes them, run once through the
        fused step: each sequence's rows attend causally over its blocks in one pass of the paged
        prefill kernel, where a prompt bucket has every row read its whole context through the
        decode kernels. Padded to the smallest long-step bucket that holds it (and at most
        ``long_seqs`` sequences) and replayed as a graph, else eagerly. (the logits of each
        sequence's last row (sequences, vocab), every row's final-normed state), fresh tensors."""
        n = len(tokens)
        if not self.long_steps:
            raise UsageError("long steps need the fused step of a GQA model (EXL3TOOLS_LONG_STEPS=1)")
        if n < 1 or not len(positions) == len(slots) == len(rows) == n:
            raise UsageError(f"a long step takes rows of equal length, got {n}, {len(positions)}, {len(slots)}, "
                             f"{len(rows)}")
        bsz = self.pool.block_size
        if max(positions) >= self.max_blocks * bsz:
            raise UsageError(f"a position reached the block tables' width ({self.max_blocks} blocks)")
        last = last_rows(rows)                       # a sequence's rows are consecutive
        starts = [0] + [e + 1 for e in last[:-1]]
        lens = [positions[e] + 1 for e in last]
        B = len(starts)
        bucket = next((b for b in self.long_buckets if b >= n), None)
        if bucket is not None and B <= self.long_seqs:
            return self._long_padded(bucket, tokens, positions, slots, [rows[s] for s in starts], starts, lens, last)
        max_new = max(e + 1 - s for s, e in zip(starts, last, strict=True))     # host ints (no sync)
        flat = sampling.on_device([*tokens, *positions, *slots, *(rows[s] for s in starts), *starts, n, *lens,
                                   *last], self.device)      # one copy, no stream sync
        tok, pos, slot, seq_rows, q_start, ctx, last = flat.split([n, n, n, B, B + 1, B, B])
        attend = self._prefill_attend(seq_rows, -(-max(lens) // bsz), q_start, ctx, max_new)
        hn = self._fused(tok, pos, slot, None, None, attend)
        return self.model.logits(hn.index_select(0, last)), hn

    def _prefill_attend(self, seq_rows: torch.Tensor, width: int, q_start: torch.Tensor, ctx: torch.Tensor,
                        max_new: int, tiles: torch.Tensor | None = None):
        """The fused step's ``attend`` for a long step: each sequence's rows (``q_start``, context
        lengths ``ctx``) through the paged prefill kernel over the slots of its table row
        (``seq_rows``, ``width`` block columns); with ``tiles`` on that fixed grid, the rows no
        tile names (a graph's padding) zeros."""
        from exl3tools.kernels.paged_attention import paged_prefill

        bsz = self.pool.block_size
        table = self.tables.index_select(0, seq_rows)[:, :width].long()
        slot_table = (table[:, :, None] * bsz + torch.arange(bsz, device=self.device)).reshape(table.shape[0], -1).int()
        q_start, ctx = q_start.int(), ctx.int()

        def attend(q, k, v, _tables, _ctx, scale):
            out = None if tiles is None else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            return paged_prefill(q, k.flatten(0, 1), v.flatten(0, 1), slot_table, q_start, ctx, scale, max_new,
                                 out=out, tiles=tiles)

        return attend

    # ------------------------------------------------------------------ long-step graphs
    def _long_layout(self, R: int) -> list[int]:
        """Entries of a bucket's packed inputs: tokens, positions, slots (R each), the sequences'
        table rows, row starts (+1), context lengths, last rows (``long_seqs`` each), row tiles."""
        from exl3tools.kernels.paged_attention import prefill_block_rows

        S = self.long_seqs
        return [R, R, R, S, S + 1, S, S, 2 * (-(-R // prefill_block_rows(self.pool.dtype)) + S)]

    def _long_inputs(self, R: int, tokens, positions, slots, seq_rows, starts, lens, last) -> list[int]:
        """A step's packed inputs in bucket ``R``: rows past ``n`` (token 0 at position 0, K/V into
        the scratch block) and sequences past ``B`` (no rows, no context) are padding; the tiles
        cover the real rows alone."""
        from exl3tools.kernels.paged_attention import prefill_block_rows, prefill_tiles

        n, B, S = len(tokens), len(starts), self.long_seqs
        pad, ps = [0] * (R - n), [0] * (S - B)
        q_start = [*starts, n] + [n] * (S - B)
        tiles = prefill_tiles(q_start, prefill_block_rows(self.pool.dtype), self._long_layout(R)[-1] // 2)
        return [*tokens, *pad, *positions, *pad, *slots, *[SCRATCH_BLOCK * self.pool.block_size] * (R - n),
                *seq_rows, *ps, *q_start, *lens, *ps, *last, *ps, *tiles]

    def _long_padded(self, R: int, tokens, positions, slots, seq_rows, starts, lens, last):
        """``long_step`` in bucket ``R``: the packed inputs in one copy, then the graph's replay (on
        CUDA; captured on first use where ``capture`` did not) or the same body eagerly."""
        inputs = self._long_inputs(R, tokens, positions, slots, seq_rows, starts, lens, last)
        self._long_entry(R).copy_(sampling.on_device(inputs, self.device))
        key = ("long", R, False, self.max_blocks)
        if self.graphs and key not in self._graphs:
            self._capture_long([R])
        if key in self._graphs:
            self._graphs[key].replay()
        else:                       # no graphs, or the capture failed (then this step alone runs padded)
            self._long_body(R)
        logits, hn = self._long_out
        return logits[:len(starts)].clone(), hn[:len(tokens)].clone()

    def _long_entry(self, R: int) -> torch.Tensor:
        """Bucket ``R``'s packed device inputs, made on first use, and the outputs every bucket's
        run writes (``_long_out``: each sequence's last row's logits, every row's final-normed
        state), made once for the largest bucket: a graph's own outputs would stay allocated in
        the graph pool, ~75 MB a bucket on air6, where its freed activations serve every capture.
        A larger bucket set later (bench/gpu_prefill_series.py) makes them again and drops the
        long graphs captured on the old ones."""
        top = max([R, *self.long_buckets])
        if self._long_out is None or self._long_out[1].shape[0] < top:
            info = self.model.info
            self._long_out = (torch.zeros(self.long_seqs, info.vocab_size, dtype=torch.float32, device=self.device),
                              torch.zeros(top, info.hidden_size, dtype=torch.float32, device=self.device))
            self._drop_long_graphs()
        if R not in self._long:
            self._long[R] = torch.zeros(sum(self._long_layout(R)), dtype=torch.int64, device=self.device)
        return self._long[R]

    def _drop_long_graphs(self) -> None:
        self._graphs = {k: g for k, g in self._graphs.items() if k[0] != "long"}

    def _long_padding(self, R: int) -> torch.Tensor:
        """A bucket's inputs with every row and sequence padding (what warm-ups and captures run)."""
        return torch.tensor(self._long_inputs(R, [], [], [], [], [], [], []), dtype=torch.int64)

    def _long_body(self, R: int) -> None:
        """The long step of bucket ``R`` from its packed inputs, device ops only, fixed shapes,
        into ``_long_out``: the logits of each sequence's last row (long_seqs, vocab), every row's
        final-normed state (its first R rows)."""
        tok, pos, slot, seq_rows, q_start, ctx, last, tiles = self._long[R].split(self._long_layout(R))
        attend = self._prefill_attend(seq_rows, self.max_blocks, q_start, ctx, R, tiles.int())
        hn = self._fused(tok, pos, slot, None, None, attend)
        logits, states = self._long_out
        logits.copy_(self.model.logits(hn.index_select(0, last)))
        states[:R].copy_(hn)

    def _capture_long(self, sizes: list[int]) -> None:
        """Capture long-step buckets; a failure (out of memory) drops them all, so long steps run
        eagerly (``long_step`` as with EXL3TOOLS_LONG_GRAPHS=0), and keeps every other graph."""
        sizes = [b for b in sizes if b in self.long_buckets]
        if not sizes:
            return
        pool = "decode" if preview.switched_on("shared_graph_pool") else "prompt"
        saved = {}
        try:
            for R in sizes:
                saved[R] = self._long_entry(R).clone()
                self._long[R].copy_(self._long_padding(R))      # warm-ups and the capture write only scratch
            self._capture_keys([((("long",), lambda bs, width, sparse: self._long_body(bs)),
                                 (False, self.max_blocks), R) for R in sorted(sizes, reverse=True)], pool=pool)
        except Exception as exc:  # noqa: BLE001 - any capture failure: OOM, a Triton build, a driver refusal
            log.warning("long-step graphs of %s rows failed, long steps run eagerly: %s", sizes,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self._drop_long_graphs()
            self.long_buckets = []
            self._pools.pop(pool, None)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        for R, v in saved.items():
            self._long[R].copy_(v)


def long_buckets(prompt_rows: int, step_rows: int | None = None) -> list[int]:
    """The long-step graphs' buckets of a decoder with ``prompt_rows``: those past its prompt
    buckets, up to the first that holds ``step_rows`` (the largest step the server plans: its
    prompt budget beside every sequence's decode rows; None: LONG_GRAPH_ROWS), and where
    ``step_rows`` is past them all (the default server: 2048 + 64), one of ``step_rows`` rounded up
    to LONG_GRAPH_ALIGN, up to LONG_GRAPH_MAX_ROWS. A bucket no planned step reaches would cost
    its capture and its outputs for nothing."""
    out, below = [], prompt_rows
    for b in sorted(LONG_GRAPH_ROWS):
        if b <= prompt_rows:
            continue
        if step_rows is not None and below >= step_rows:
            break
        out.append(b)
        below = b
    if step_rows is not None and below < step_rows:
        fit = -(-step_rows // LONG_GRAPH_ALIGN) * LONG_GRAPH_ALIGN
        if max(prompt_rows, *LONG_GRAPH_ROWS) < fit <= LONG_GRAPH_MAX_ROWS:
            out.append(fit)
    return out


def long_graph_rows(model: CausalLM, prompt_rows: int, step_rows: int | None = None) -> int:
    """The rows of the largest long-step graph a CUDA decoder of ``model`` captures, for the KV
    budget's graph reserve (0: none; long_graphs where long steps run: a GQA model with the fused
    step, long_steps and long_graphs not off, no batch-invariant serving)."""
    from exl3tools.runtime import fused_step, invariance

    dev = model.embed.device
    on = (dev.type == "cuda" and preview.on_cuda("long_graphs", dev) and preview.on_cuda("long_steps", dev)
          and fused_step.supports(model) and not invariance.on())
    return max(long_buckets(prompt_rows, step_rows), default=0) if on else 0


def last_rows(rows: list[int]) -> list[int]:
    """Index of each sequence's last row in a step's rows (``rows``: each row's slot row; a
    sequence's rows are consecutive)."""
    return [i for i in range(len(rows)) if i + 1 == len(rows) or rows[i + 1] != rows[i]]
