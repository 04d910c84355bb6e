"""The runtime's public contract: ``load_runner(path) -> Runner``; ``Runner.step(batch) -> logits``.

The HTTP server and ``exl3tools generate`` build on this and nothing deeper (``load_runner``
lives in runtime/load.py, what a rank builds in runtime/rank_model.py; both are re-exported
here). A Runner owns the model, the tokenizer and the KV caches of the sequences it was told about. ``step`` takes any mix
of prefill (many tokens for one sequence) and decode (one token for many sequences): a step of at
most ``max_num_seqs`` new tokens (``max_num_seqs * (1 + speculative_tokens)`` with MTP, whose verify
is 1 + k rows a sequence) runs the fixed-shape decode step (CUDA graphs per batch bucket, one row
per token), a larger one a packed eager forward. The KV cache is paged (block manager on rank 0, a
pool of blocks on every rank) with prefix caching. With ``tp > 1`` the Runner lives on rank 0 and
drives the other ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Hashable

import torch

from exl3tools.errors import Exl3Error, RuntimeFailure, UsageError
from exl3tools.runtime import distributed as D
from exl3tools.runtime import invariance, preview, sampling
from exl3tools.runtime.load import load_runner  # noqa: F401  (the public entry point, re-exported)
from exl3tools.runtime.long_steps import last_rows, long_graph_rows
from exl3tools.runtime.mla import has_mla
from exl3tools.runtime.model import CausalLM
from exl3tools.runtime.peer_link import PeerLink
from exl3tools.runtime.rank_model import build_local_model, rank_device  # noqa: F401
from exl3tools.runtime.rank_state import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DraftState,
    PagedState,
    kv_budget_blocks,
    rows_of,
)
from exl3tools.runtime.speculative import SpeculativeSteps
from exl3tools.runtime.text_meta import read_text_meta
from exl3tools.text import first_line, printable

DEFAULT_CACHE_TOKENS = 32768          # the CPU's KV cache when no budget is given
PROMPT_GRAPH_ROWS = 512               # prompt steps of up to this many rows replay graphs (prompt_graphs)
# a prompt step's rows each read their whole context through the decode kernels (no prefill
# kernel's one pass): steps whose multi-row sequences read more (rows x context) run eagerly
PROMPT_GRAPH_READS = 512 * 512

log = logging.getLogger("exl3tools.runtime")


class CacheFullError(RuntimeFailure):
    """The KV cache budget (max_cache_tokens) cannot hold the requested tokens."""


class ContextLengthError(UsageError):
    """A sequence would grow past the model's max_context."""


# ------------------------------------------------------------------ rank 0 side
class Runner(SpeculativeSteps, PeerLink):
    """Model + tokenizer + the paged KV cache; see module doc. Not thread-safe: call from one thread.

    The cache is a pool of ``block_size``-token blocks (runtime/block_manager.py owns them,
    runtime/kv_pool.py holds the tensors). Its size comes from ``max_cache_tokens`` when given,
    else on a CUDA device from a memory budget: ``gpu_memory_utilization`` of the GPU, less what
    is in use after loading (weights, CUDA context) and the activation peak of one eager step of
    ``max_num_batched_tokens`` tokens (measured), less ``GRAPH_RESERVE`` for graphs and logits;
    else ``DEFAULT_CACHE_TOKENS``. ``decode``: "graphs" (CUDA graphs per batch bucket), "static"
    (the same fixed-shape step, no graphs), "eager", or None: graphs on CUDA, eager elsewhere. On
    one rank a failed capture (out of memory, a kernel that does not build) falls back to eager.
    """

    def __init__(self, model: CausalLM, ckpt_dir: Path, name: str, *, world: int = 1, procs=(),
                 max_cache_tokens: int | None = None, opened: dict | None = None, max_num_seqs: int = 32,
                 block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str = "auto",
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, decode: str | None = None,
                 prefix_caching: bool = True, max_num_batched_tokens: int = 512, speculative_tokens: int = 0,
                 prompt_rows: int | None = None):
        from exl3tools.runtime.block_manager import BlockManager
        from exl3tools.runtime.kv_pool import (
            bytes_per_token,
            kv_dtype_for,
            layer_specs,
            mtp_budget,
        )

        self.model = model
        self.world, self._procs = world, list(procs)
        self.model_name = name
        self.vocab_size = model.info.vocab_size
        self.opened_files = opened or {}       # rank -> files opened while loading (when traced)
        self._closed = False
        # why the tensor-parallel group broke (a peer died, a step failed half-way): the ranks
        # are out of step for good, so every later step refuses and the server stops (engine.py)
        self.lost: str | None = None
        self.max_num_seqs = int(max_num_seqs)
        self.spec_k = int(speculative_tokens)
        if self.spec_k < 0:
            raise UsageError(f"--speculative-tokens must be >= 0, got {speculative_tokens}")
        if self.spec_k and getattr(model, "mtp", None) is None:
            raise UsageError(f"{name}: this checkpoint has no MTP head that exl3tools loads, which speculative "
                             "decoding (--speculative-tokens, --mtp) needs: GLM-5 (glm_moe_dsa) and DeepSeek-V3 "
                             "carry it as model.layers.{num_hidden_layers}.* (exllamav3's converter drops "
                             "DeepSeek-V3's)")
        dev = model.embed.device
        if not 0 < gpu_memory_utilization <= 1:
            raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
        dtype = kv_dtype_for(kv_dtype, dev, mla=has_mla(model))
        self._row_steps = preview.switched_on("row_steps")
        self.invariant = invariance.on()
        if prompt_rows is None:     # prompt graphs (runtime/preview.py): on CUDA unless "0", elsewhere if "1"
            on = self._row_steps and preview.on_cuda("prompt_graphs", dev)
            prompt_rows = min(PROMPT_GRAPH_ROWS, int(max_num_batched_tokens) + self.max_num_seqs) if on else 0
        if self.invariant:          # every step in the fixed-shape step: none may need the eager forward
            if world > 1 or dev.type != "cuda" or not prompt_rows:
                raise UsageError("batch-invariant serving runs at TP 1 on CUDA with row steps and prompt graphs "
                                 "(EXL3TOOLS_ROW_STEPS and EXL3TOOLS_PROMPT_GRAPHS not 0)")
            prompt_rows = int(max_num_batched_tokens) + self.max_num_seqs
        # the largest step the server plans: its prompt budget beside every sequence's decode rows
        # (long-step graphs are captured up to the first bucket that holds it)
        step_rows = int(max_num_batched_tokens) + self.max_num_seqs * (1 + self.spec_k)
        # the MTP head's cache in the block pool, its drafts in the fixed-shape step
        # (on unless EXL3TOOLS_MTP_PAGED=0: runtime/preview.py)
        mtp_paged = bool(self.spec_k and preview.switched_on("mtp_paged"))
        specs = layer_specs(model)
        per_token = bytes_per_token(specs, dtype)
        head_token, head_seq = mtp_budget(model, self.spec_k, dtype, paged=mtp_paged)
        weights_bytes = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
        self.weights_bytes = weights_bytes   # what the model holds on the device before the cache
        if max_cache_tokens is not None:
            if int(max_cache_tokens) < 1:
                raise UsageError(f"max_cache_tokens must be >= 1, got {max_cache_tokens}")
            num_blocks = -(-int(max_cache_tokens) // block_size) + 1
        elif dev.type == "cuda":
            # DSA's sparse prompt graphs hold float32 indexer scores (and top-k scratch) of every
            # row against the whole table: 512 rows x 202752 keys x 4 B = 415 MB, twice
            dsa = any(getattr(layer.attn, "index_topk", 0) for layer in model.layers)
            scores = 8 * prompt_rows * model.info.max_context if dsa else 0
            num_blocks = self._budget_blocks((per_token + head_token) * block_size, gpu_memory_utilization,
                                             max_num_batched_tokens, str(dtype).removeprefix("torch."),
                                             reserve=head_seq * self.max_num_seqs + scores,
                                             # MTP's verify buckets (1 + k rows a sequence) get their
                                             # graphs' activations counted beside the prompt buckets'
                                             graph_rows=prompt_rows + (self.max_num_seqs * (1 + self.spec_k)
                                                                       if self.spec_k else 0)
                                             + long_graph_rows(model, prompt_rows, step_rows))
        else:
            num_blocks = DEFAULT_CACHE_TOKENS // block_size + 1
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.block_size = block_size
        self.max_context = min(model.info.max_context, self.blocks.usable_blocks * block_size)
        if self.max_context < model.info.max_context:
            log.warning("the KV cache holds %d tokens: the longest context is %d, not %d",
                        self.blocks.usable_blocks * block_size, self.max_context, model.info.max_context)
        mode = self._decode_mode(decode)
        max_blocks = -(-self.max_context // block_size)
        state = dict(num_blocks=num_blocks, block_size=block_size, dtype=str(dtype).removeprefix("torch."),
                     max_seqs=self.max_num_seqs, max_blocks=max_blocks, decode=mode,
                     mtp_paged=mtp_paged,
                     # a verify is 1 + k rows a sequence: the step takes every sequence's at once
                     max_rows=self.max_num_seqs * (1 + self.spec_k),
                     # larger buckets for prompt steps (short prompts beside decoding rows)
                     prompt_rows=int(prompt_rows), step_rows=step_rows)
        self._send(("kv_init", state))
        self.paged = PagedState(model, **state)
        self.decode_mode = mode
        # the last step's: "decode", "prompt" (graph buckets), "long" (PagedDecoder.long_step) or "eager"
        self.last_path: str | None = None
        self._warned_eager = False           # batch-invariant runs: an eager step was logged
        if mode == "graphs":
            self._capture()
        self._rows = list(range(self.max_num_seqs))
        self._seqs: dict[Hashable, _Seq] = {}
        log.info("KV cache: %d blocks x %d tokens (%s, %d B/token%s), %.2f GiB%s; longest context %d tokens; "
                 "decode %s, up to %d sequences", self.blocks.usable_blocks, block_size, state["dtype"], per_token,
                 f" + the MTP head's {head_token}" if self.paged.head_pool is not None else "",
                 self.paged.nbytes() / 2**30,
                 "" if weights_bytes is None else f"; weights {weights_bytes / 2**30:.2f} GiB",
                 self.max_context, self.decode_mode, self.max_num_seqs)
        meta = read_text_meta(ckpt_dir)
        self.tokenizer, self.chat_template = meta.tokenizer, meta.chat_template
        self.eos_token_ids, self.eos_token = meta.eos_token_ids, meta.eos_token
        self.bos_token_id, self.bos_token = meta.bos_token_id, meta.bos_token
        self.generation_defaults = meta.generation_defaults
        self.on_lost: Callable[[], None] | None = None     # called when the TP group is lost (PeerLink)
        self._start_watch()

    def _budget_blocks(self, block_bytes: int, util: float, batched_tokens: int, dtype: str,
                       reserve: int = 0, graph_rows: int = 0) -> int:
        """The fewest KV blocks any rank's GPU holds (rank_state.kv_budget_blocks): every rank
        allocates the same blocks, so one measured on rank 0 alone overran a worker's GPU that
        held more (another process, a larger slice)."""
        self._send(("kv_budget", block_bytes, util, int(batched_tokens), dtype, reserve, graph_rows))
        mine = kv_budget_blocks(self.model, block_bytes, util, batched_tokens, dtype, reserve, graph_rows)
        ranks = D.gather_ints(mine) if self.world > 1 else [mine]
        self.kv_blocks_by_rank = ranks
        rank = min(range(len(ranks)), key=ranks.__getitem__)
        if ranks[rank] < 2:
            where = f" on rank {rank}" if self.world > 1 else ""
            raise CacheFullError(f"no GPU memory left for the KV cache{where} (room for {ranks[rank]} blocks of "
                                 f"{block_bytes / 2**20:.1f} MiB at --gpu-memory-utilization {util}); raise it "
                                 "or use more GPUs")
        return int(ranks[rank])

    def _decode_mode(self, decode: str | None) -> str:
        from exl3tools.runtime.paged_decode import check

        if decode not in (None, "eager", "static", "graphs"):
            raise UsageError(f"decode must be eager, static or graphs, got {decode!r}")
        cuda = self.model.embed.device.type == "cuda"
        want = decode or ("graphs" if cuda else "eager")
        if want == "eager":
            return want
        try:
            check(self.model)
        except Exl3Error as exc:
            (log.warning if decode is not None else log.info)("fixed-shape decode off, decoding eagerly: %s", exc)
            return "eager"
        if want == "graphs" and not cuda:
            raise UsageError("CUDA graphs need a CUDA device")
        return want

    def _capture(self) -> None:
        """Capture the decode graphs; on one rank, a failure decodes eagerly instead of refusing to
        serve (the ranks of a TP group must agree on the mode, so there it stays an error)."""
        self._send(("capture",))
        t0 = time.perf_counter()
        try:
            self.paged.decoder.capture()
            d = self.paged.decoder
            log.info("CUDA graphs: %d captured in %.1f s (decode buckets up to %d rows%s)", d.graphs_captured,
                     time.perf_counter() - t0, d.max_rows,
                     f", prompt buckets up to {d.prompt_buckets[-1]}" if d.prompt_buckets else "")
        except Exception as exc:  # noqa: BLE001 - any capture failure: OOM, a Triton build, a driver refusal
            if self.world > 1:
                raise
            log.warning("CUDA graph capture failed, decoding eagerly (slower): %s", printable(first_line(exc)))
            self.paged.decoder = None
            self.decode_mode = "eager"
            if self.model.embed.device.type == "cuda":
                torch.cuda.empty_cache()

    # -- sequences
    def add_sequence(self, seq_id: Hashable, tokens: list[int] | tuple[int, ...] = (), *,
                     speculative: bool = True) -> int:
        """Start ``seq_id``. With ``tokens`` (its prompt, or prompt + output after a preemption),
        whole blocks of them already in the prefix cache are reused: returns how many tokens are
        cached (the caller sends only the rest to ``step``). ``speculative``: keep the MTP draft
        state for it (only when the Runner has ``speculative_tokens``)."""
        if seq_id in self._seqs:
            raise UsageError(f"sequence {seq_id!r} already exists")
        if not self._rows:
            raise CacheFullError(f"all {self.max_num_seqs} sequence slots are in use")
        # open() converts a block's ids to ints as it looks them up (and stops at the first miss):
        # converting a whole 2048-token prompt here took 0.2 ms a sequence on the engine thread
        cached = self.blocks.open(seq_id, tokens[:self.max_context])
        seq = self._seqs[seq_id] = _Seq(self._rows.pop(0), list(tokens[:cached]))
        if self.spec_k and speculative:
            seq.spec = DraftState(self.model.mtp, paged_start=cached if self.paged.head_pool is not None else None)
        return cached

    def free_sequence(self, seq_id: Hashable) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is not None:
            self.blocks.free(seq_id)
            self._rows.append(s.row)
            if s.spec is not None and not self.lost:
                self._send(("sfree", seq_id))

    def sequence_length(self, seq_id: Hashable) -> int:
        self._seq(seq_id)
        return self.blocks.length(seq_id)

    def cache_tokens_used(self) -> int:
        return sum(self.blocks.length(k) for k in self._seqs)

    def decode_reads(self):
        """Weight bytes rank 0 reads per decode step (exl3tools/roofline.py), from the headers
        build_local_model read; None where it could not tell (it logged why)."""
        return self.model.weight_reads

    def cache_tokens_free(self) -> int:
        return self.blocks.free_blocks() * self.block_size

    def blocks_needed(self, appends: list[tuple[Hashable | None, int]]) -> int:
        """Blocks that each (sequence or None for a new one, new tokens) at once would take."""
        return sum(self.blocks.new_blocks_needed(s if s in self._seqs else None, n) for s, n in appends)

    def fits(self, appends: list[tuple[Hashable | None, int]], held: int = 0) -> bool:
        """Whether the cache can take each (sequence or None for a new one, new tokens) at once,
        beside ``held`` blocks already promised (a blocks_needed of other appends)."""
        return held + self.blocks_needed(appends) <= self.blocks.free_blocks()

    def prefix_stats(self):
        return self.blocks.stats()

    @property
    def kv_cache_dtype(self) -> str:
        """The paged pool's element type ("float32", "bfloat16", ...), as /v1/engine/stats reports it."""
        return str(self.paged.pool.dtype).removeprefix("torch.")

    def memory_stats(self) -> dict | None:
        """Rank 0's device memory in bytes: weights, KV pool, torch's allocated / reserved / peak
        (None on the CPU): what serve holds beside weights and cache."""
        dev = self.model.embed.device
        if dev.type != "cuda":
            return None
        return {"weights": self.weights_bytes, "kv_pool": self.paged.nbytes(), "allocated": torch.cuda.memory_allocated(dev),
                "reserved": torch.cuda.memory_reserved(dev), "peak_allocated": torch.cuda.max_memory_allocated(dev)}

    def _seq(self, seq_id):
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UsageError(f"unknown sequence {seq_id!r} (call add_sequence first)") from None

    # -- forward
    def step(self, batch: list[tuple[Hashable, list[int]]], *, all_logits: bool = False,
             device_logits: bool = False) -> torch.Tensor:
        """Append each sequence's new tokens to its cache; float32 logits ``[len(batch), vocab]``
        after each sequence's last new token (``all_logits``: ``[total new tokens, vocab]``), on
        the CPU, or on the model's device with ``device_logits``."""
        if self._closed:
            raise RuntimeFailure("runner is closed")
        if not batch:
            return torch.empty(0, self.vocab_size)
        seen, items = set(), []
        vocab = self.model.embed.shape[0]
        for seq_id, toks in batch:
            if seq_id in seen:
                raise UsageError(f"sequence {seq_id!r} appears twice in one step")
            seen.add(seq_id)
            seq = self._seq(seq_id)
            if seq.unknown or seq.pending is not None:
                raise UsageError(f"sequence {seq_id!r}: a chained or verify step is not committed yet")
            toks = [int(t) for t in toks]
            if not toks:
                raise UsageError(f"sequence {seq_id!r}: no new tokens")
            bad = [t for t in toks if not 0 <= t < vocab]
            if bad:
                raise UsageError(f"token id {bad[0]} out of range 0..{vocab - 1}")
            items.append((seq_id, seq, toks, self._length_before(seq_id, len(toks))))
        self._check_room([(s, len(t)) for s, _, t, _ in items])
        slots = [self.blocks.reserve(s, len(t)) for s, _, t, _ in items]
        eager_spec = []       # sequences whose prompt chunk took the eager forward: the head catches up
        try:
            self.last_path = self._step_path(items, all_logits)
            if self.last_path != "eager":
                spec = [(s if seq.spec is not None else None, len(t)) for s, seq, t, _ in items]
                logits, hn = self._decode(items, slots, spec=spec, long=self.last_path == "long")
                rows = hn.split([len(t) for _, _, t, _ in items])
                for (_, seq, t, _), states in zip(items, rows, strict=True):
                    if seq.spec is not None:
                        seq.spec.extend(states.clone(), t)
                # a view of the step's static output: copy the rows asked for (a prompt step's
                # are each sequence's last row already; a long step's are a tensor of their own)
                if all_logits or self.last_path == "prompt":
                    logits = logits.clone()
                elif self.last_path == "decode":
                    logits = logits[sampling.on_device(last_rows([seq.row for _, seq, t, _ in items for _ in t]),
                                                       logits.device)]          # no stream sync
            else:
                wire = [(list(self.blocks.table(s)), n0, t) for s, _, t, n0 in items]
                spec_ids = [s if seq.spec is not None else None for s, seq, _, _ in items]
                self._send(("pstep", wire, all_logits, spec_ids))
                if any(seq.spec is not None for _, seq, _, _ in items):
                    logits, hn = self.paged.forward(wire, all_logits=all_logits, states=True)
                    for (s, seq, t, _), states in zip(items, rows_of(hn, wire), strict=True):
                        if seq.spec is not None:
                            seq.spec.extend(states, t)
                            eager_spec.append(s)
                else:
                    logits = self.paged.forward(wire, all_logits=all_logits)
        except RuntimeError as exc:
            if self.world > 1:
                self.lost = self.lost or f"tensor-parallel step failed: {first_line(exc)}"
                raise RuntimeFailure(self.lost) from exc
            raise
        # only now are the K/V written: a failed step commits nothing, so no block it touched is ever
        # hashed into the prefix cache (its reserved blocks go back with the sequence)
        for s, seq, t, _ in items:
            seq.tokens.extend(t)
            self.blocks.commit(s, seq.tokens)
        if eager_spec:
            self._catch_up(eager_spec)
        return logits if device_logits else logits.float().cpu()

    def _length_before(self, seq_id: Hashable, n: int) -> int:
        """The sequence's cached length, refusing a step of ``n`` tokens past max_context."""
        n0 = self.blocks.length(seq_id)
        if n0 + n > self.max_context:
            raise ContextLengthError(f"sequence {seq_id!r} would reach {n0 + n} tokens, more than max_context "
                                     f"{self.max_context}")
        return n0

    def _check_room(self, appends: list[tuple[Hashable, int]]) -> None:
        if not self.fits(appends):
            raise CacheFullError(f"KV cache full: {sum(n for _, n in appends)} new tokens do not fit in "
                                 f"{self.blocks.free_blocks()} free blocks of {self.block_size}")

    def prompt_graph_limits(self) -> tuple[int, int] | None:
        """(rows, context reads) within which a step of prompt rows replays a prompt graph instead
        of the eager forward (the largest prompt bucket, PROMPT_GRAPH_READS: ``_step_path``); None
        without prompt graphs or where every step takes them (batch-invariant runs)."""
        d = self.paged.decoder
        if d is None or not d.prompt_buckets or self.invariant:
            return None
        return d.prompt_buckets[-1], PROMPT_GRAPH_READS

    def _step_path(self, items: list, all_logits: bool = False) -> str:
        """How a step runs: "decode" where its rows (every new token is one) fit the fixed-shape
        decode step, so a short prompt, a prefix hit's recomputed tail or a verify replays a graph,
        not an eager forward (launch-bound at a few tokens: ~20 ms for 16 tokens on an H200);
        "prompt" past the decode buckets, for a step (``prompt_rows``) that wants the last rows'
        logits only and whose sequences of several rows read at most PROMPT_GRAPH_READS context
        tokens (decoding rows beside them may sit at any context, DSA selecting for them); "long"
        for the other steps without every row's logits where the decoder has a long step (the
        long_steps default on CUDA: the fused glue once, the prefill kernel's attention, replayed
        as a graph where a long_graphs bucket holds the step, else eagerly);
        else "eager"."""
        d = self.paged.decoder
        if d is None:
            return "eager"
        n = sum(len(t or [0]) for _, _, t, _ in items)
        if n <= d.max_rows:
            # several rows of one sequence (EXL3TOOLS_ROW_STEPS=0: the eager forward, runtime/preview.py)
            return "decode" if self._row_steps or all(len(t or [0]) == 1 for _, _, t, _ in items) else "eager"
        # the decoder's long step (long_steps: on CUDA unless "0") where a prompt bucket does not
        # take the step: one eager pass of the fused glue, the prefill kernel's attention
        long = d.long_steps and not all_logits
        if all_logits or not d.prompt_buckets or n > d.prompt_buckets[-1]:
            if long:
                return "long"
            if self.invariant and not self._warned_eager:
                self._warned_eager = True
                log.warning("a step of %d rows%s takes the eager forward: its logits are not batch-invariant", n,
                            " with every row's logits (prompt logprobs)" if all_logits else "")
            return "eager"
        reads = sum(len(t) * (n0 + len(t)) for _, _, t, n0 in items if t is not None and len(t) > 1)
        # batch-invariant runs: every prompt through the fixed-shape step, whatever it reads
        if reads <= PROMPT_GRAPH_READS or self.invariant:
            return "prompt"
        return "long" if long else "eager"

    def _decode_args(self, items: list, slots: list[list[int]]) -> tuple:
        """The decode step's rows: each new token of each sequence at its position and slot,
        reading its sequence's block-table row (a chained item, tokens None, is one row)."""
        updates, tokens, positions, flat, rows = [], [], [], [], []
        for (s, seq, t, n0), sl in zip(items, slots, strict=True):
            table = self.blocks.table(s)
            updates.extend((seq.row, c, table[c]) for c in range(seq.synced, len(table)))
            seq.synced = len(table)
            t = t or [0]
            tokens.extend(t)
            positions.extend(range(n0, n0 + len(t)))
            flat.extend(sl[:len(t)])
            rows.extend([seq.row] * len(t))
        return tokens, positions, flat, rows, updates

    def _decode(self, items: list, slots: list[list[int]], device_tokens: torch.Tensor | None = None,
                spec: list | None = None, long: bool = False):
        """Logits of every row (``long``: the decoder's long step, each sequence's last row's); with
        ``spec`` ((draft-state id or None, rows) per item, sent to the workers so they feed their
        head too): (logits, final-normed states)."""
        args = self._decode_args(items, slots)
        self._send(("pdecode", *args, spec, device_tokens is not None, long))
        if device_tokens is not None:
            device_tokens = self._share(device_tokens)
        if spec is None:
            return self.paged.decode(*args, device_tokens, long=long)
        return self.paged.decode(*args, device_tokens, states=True, long=long)

    @property
    def can_chain(self) -> bool:
        """Whether ``step_chained`` works here: the fixed-shape decode step, no MTP drafts (a chained
        row's token is unknown when its draft state would need it). At TP > 1 the tokens reach
        the workers by a broadcast on the device (``_decode``)."""
        return self.paged.decoder is not None and not self.spec_k

    def step_chained(self, seq_ids: list[Hashable], tokens: torch.Tensor) -> torch.Tensor:
        """A decode step whose input tokens are a device tensor (the previous step's samples, in
        ``seq_ids`` order), launched before anyone reads them: the host prepares step N+1 while
        the GPU runs step N. Device logits ``[len(seq_ids), vocab]``. The cache grows by one token
        per sequence now; ``commit_tokens`` tells the runner those tokens once they are known
        (prefix hashing needs them); until then the sequence takes no other step."""
        if not self.can_chain:
            raise UsageError("chained decode steps need the fixed-shape decode step and no MTP drafts")
        if self._closed:
            raise RuntimeFailure("runner is closed")
        if not 1 <= len(seq_ids) <= self.max_num_seqs or len(set(seq_ids)) != len(seq_ids):
            raise UsageError(f"a chained step takes 1..{self.max_num_seqs} distinct sequences")
        items = [(s, self._seq(s), None, self._length_before(s, 1)) for s in seq_ids]
        self._check_room([(s, 1) for s in seq_ids])
        slots = [self.blocks.reserve(s, 1) for s in seq_ids]
        logits = self._decode(items, slots, tokens).clone()
        for s, seq, _, _ in items:
            self.blocks.advance(s, 1)
            seq.unknown += 1
        return logits

    # (speculative decoding, draft / verify / accept: runtime/speculative.py)
    def commit_tokens(self, pairs: list[tuple[Hashable, int]]) -> None:
        """The input tokens of a chained step, now known (sequences freed meanwhile are skipped)."""
        for s, t in pairs:
            seq = self._seqs.get(s)
            if seq is None or not seq.unknown:
                continue
            seq.tokens.append(int(t))
            seq.unknown -= 1
            if not seq.unknown:
                self.blocks.commit(s, seq.tokens)

    # -- lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._seqs.clear()
        self._close_peers()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Seq:
    """A live sequence on rank 0: its slot row of the decode step's block tables, the tokens in
    its cache (prefix hashing needs them) and how many table entries the device has."""

    __slots__ = ("row", "tokens", "synced", "unknown", "spec", "pending")

    def __init__(self, row: int, tokens: list[int]):
        self.row, self.tokens, self.synced = row, tokens, 0
        self.unknown = 0     # tokens written by chained steps, not committed yet
        self.spec: DraftState | None = None     # MTP draft state (speculative decoding)
        self.pending = None  # (tokens, states) of a verify step not accepted yet
