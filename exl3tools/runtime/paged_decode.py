"""Decode steps over the paged KV cache with fixed shapes: one CUDA graph per batch-size bucket.

``PagedDecoder(model, pool, max_seqs, max_blocks, max_rows=)`` owns the static inputs of a decode
step -- token ids, positions, the slot each new K/V goes to, each row's block-table row and context
length -- and a device block-table matrix with one row per sequence *slot* (the runner gives each
live sequence a slot; only the blocks it gains are copied to the device, never the whole table). A
step of ``n`` rows runs the smallest bucket ``>= n`` (``buckets``: 1, 2, 4, ... up to ``max_rows``,
more than ``max_seqs`` where MTP verifies ``1 + k`` rows a sequence); padded rows write their K/V
into the pool's scratch block and attend over nothing. With ``prompt_rows`` larger buckets take
prompt steps (short prompts beside decoding rows, at any context) that would otherwise run the eager forward:
launch-bound at a few hundred tokens (~20 ms for 32 tokens on an H200, GLM-4.5-Air shape, where
a replay of 8 rows takes ~3 ms).

Per layer, by attention kind:

- GQA (llama, qwen3_moe, glm4_moe): q/k/v (+ norms, RoPE) as the eager attention, the new K/V
  written with ``index_copy_`` at their slots, attention through the block tables
  (``kernels.paged_attention``: Triton on CUDA, the same contract in plain torch elsewhere);
- MLA (deepseek_v3, glm_moe_dsa): ``MLAttention.decode_static`` (runtime/mla.py): the latent
  ``ckv``/``kpe`` (and DSA ``kidx``) written at the slots, absorbed queries through
  ``kernels.mla_attention`` (one latent tile per head group, split-K); a DSA "full" layer scores the
  token against its paged keys (``kernels.dsa_indexer``) and selects on the device exactly as
  ``Indexer.select`` (``dsa.topk_positions``), a "shared" layer reuses that selection (``StepInputs.extras``);

then the MLP (``MoE.forward_static``: no host sync; dense MLPs as they are). Cost follows the
sequences' real lengths, never ``max_blocks`` (a DSA layer's attention reads its ``index_topk``
selected rows; its indexer reads every key).

With ``graphs=True`` (CUDA) every bucket is captured once, largest first, into one shared memory
pool, and a step is: one host-to-device copy of the packed inputs, one replay. With a
``head_pool`` (the MTP head's cache in blocks) the head's draft step (``draft``) is captured per
bucket beside it.

``fused`` (default: on CUDA unless ``EXL3TOOLS_FUSED=0``; fused_step.resolve): GQA models' layers run through
``runtime.fused_step`` (Triton glue kernels: residual + RMSNorm, q/k norm + RoPE + K/V write,
routing, SiLU*mul; docs/gpu.md "Fused decode step"); off (and for MLA models), the torch loop below.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass, field

import torch

from exl3tools.errors import UnsupportedArchitectureError, UsageError
from exl3tools.runtime import preview, sampling
from exl3tools.runtime.block_manager import SCRATCH_BLOCK
from exl3tools.runtime.kv_pool import KVPool
from exl3tools.runtime.layers import Attention, DecoderLayer, GatedMLP, MoE
from exl3tools.runtime.long_steps import LongSteps, last_rows
from exl3tools.runtime.mla import MLAttention
from exl3tools.runtime.model import CausalLM

log = logging.getLogger("exl3tools.runtime")

WARMUP_STEPS = 2     # eager runs before a capture: Triton compiles, lazy buffers, cuBLAS handles
N_INPUTS = 6         # packed host inputs: tokens, positions, slots, slot rows, context lengths, logit rows
WIDTH_MIN_TOKENS = 4096   # the narrowest block-table width a sparse DSA graph is captured for


def buckets(max_rows: int) -> list[int]:
    """Batch sizes a step is padded to: 1, 2, 4, 8, 16, 24, 32, 48, 64, then 1.5x and 2x each power
    of two (96, 128, 192, 256, 384, ...; at most a third of a bucket is padding), and ``max_rows``."""
    ladder, p = [1, 2, 4, 8, 16, 24, 32, 48, 64], 64
    while p < max_rows:
        ladder += [p * 3 // 2, p * 2]
        p *= 2
    return [b for b in ladder if b < max_rows] + [int(max_rows)]


def widths(max_blocks: int, block_size: int) -> list[int]:
    """Block-table widths (blocks) of the sparse DSA graphs (``dsa_widths``, on unless EXL3TOOLS_DSA_WIDTHS=0): doubling
    from WIDTH_MIN_TOKENS to the full width, so a step's indexer scores and its top-k span at
    most twice its longest context instead of every --max-model-len column (GLM-5 at 202k: ~100x
    the work of a 4k context, on every DSA layer of every step)."""
    w, out = max(1, -(-WIDTH_MIN_TOKENS // block_size)), []
    while w < max_blocks:
        out.append(w)
        w *= 2
    return out + [int(max_blocks)]


# the Triton MLA kernel on the CPU too (Triton's interpreter; tests of the GPU path's logic)
MLA_DECODE_ON_CPU = os.environ.get("EXL3TOOLS_MLA_DECODE_CPU") == "1"


def check(model: CausalLM) -> None:
    """Raise where the static decode step cannot run ``model`` (GQA and MLA/DSA layers only)."""
    for i, layer in enumerate(model.layers):
        if not (isinstance(layer, DecoderLayer) and (type(layer.attn) is Attention or isinstance(layer.attn, MLAttention))
                and isinstance(layer.mlp, (GatedMLP, MoE))):
            raise UnsupportedArchitectureError(
                f"the static decode step supports GQA and MLA models (llama, qwen3_moe, glm4_moe, deepseek_v3, "
                f"glm_moe_dsa); {model.info.architecture} layer {i} has {type(layer.attn).__name__} attention")


def attention_fn(device: torch.device):
    from exl3tools.kernels import paged_attention

    return paged_attention.paged_decode if device.type == "cuda" else paged_attention.paged_decode_reference


def invariant_attention(attend, table_tokens: int):
    """``attend`` (kernels.paged_attention.paged_decode) with the splits of batch-invariant runs
    (``invariant_splits``): each row's keys split at the same tiles whatever the step's rows."""
    from exl3tools.kernels.paged_attention import invariant_splits

    def run(q, k, v, tables, ctx, scale):
        splits, tiles = invariant_splits(table_tokens, q.shape[-1], k.dtype)
        return attend(q, k, v, tables, ctx, scale, num_splits=splits, min_split_tiles=tiles)
    return run


def mla_attention_fn(device: torch.device):
    """(MLA decode attention, DSA indexer scores, DSA top-k): Triton on CUDA (or the interpreter
    with MLA_DECODE_ON_CPU), else the torch references (None: runtime.dsa.paged_scores_reference,
    runtime.dsa.topk_positions)."""
    from exl3tools.kernels import mla_attention

    if device.type == "cuda" or MLA_DECODE_ON_CPU:
        from exl3tools.kernels import dsa_indexer

        # chunked top-k at wide tables unless "0"; "1" takes it at every width (tests/gpu runs it so)
        topk = (dsa_indexer.topk_select_chunked if preview.asked_for("dsa_topk_chunks") else
                dsa_indexer.topk_auto if preview.switched_on("dsa_topk_chunks") else dsa_indexer.topk_select)
        scores = dsa_indexer.paged_scores_tc if preview.switched_on("dsa_scores_tc") else dsa_indexer.paged_scores
        return mla_attention.mla_decode, scores, topk
    return mla_attention.mla_decode_reference, None, None


@dataclass(slots=True)
class StepInputs:
    """What a layer's ``decode_static`` reads besides its input rows (MLAttention.decode_static)."""

    positions: torch.Tensor      # (bs,) int64
    slots: torch.Tensor          # (bs,) int64: where each row's new cache entries go
    tables: torch.Tensor         # (bs, width) int32 block-table rows
    ctx: torch.Tensor            # (bs,) int32 context lengths, the new token included
    pool: KVPool
    mla_attend: object           # kernels.mla_attention's mla_decode or its reference
    dsa_scores: object = None    # indexer scores over the paged keys (None: dsa.paged_scores_reference)
    dsa_topk: object = None      # their top-k positions (None: dsa.topk_positions)
    extras: dict = field(default_factory=dict)   # per step: the DSA selection shared layers reuse
    sparse: bool = True          # False: every row's context fits index_topk, so DSA selects everything


class PagedDecoder(LongSteps):
    def __init__(self, model: CausalLM, pool: KVPool, max_seqs: int, max_blocks: int, *, graphs: bool = False,
                 fused: bool | None = None, head_pool: KVPool | None = None, max_rows: int | None = None,
                 prompt_rows: int | None = None, step_rows: int | None = None):
        check(model)
        if max_seqs < 1 or max_blocks < 1:
            raise UsageError(f"paged decode needs max_seqs >= 1 and max_blocks >= 1 (got {max_seqs}, {max_blocks})")
        self.model, self.pool = model, pool
        self.max_seqs, self.max_blocks = int(max_seqs), int(max_blocks)
        # rows a step takes (block-table rows stay max_seqs): an MTP verify of 32 sequences with one
        # draft each is 64 rows, which would otherwise run the eager forward (H200, GLM-5 shape,
        # 32 streams at --speculative-tokens 1: 158 tok/s against 1749 without MTP)
        self.max_rows = max(self.max_seqs, int(max_rows or 0))
        # prompt steps (``prompt_rows`` > max_rows): up to that many rows -- short prompts beside
        # decoding sequences -- in larger buckets of the main step only (no MTP draft graphs),
        # with the logits of each sequence's last row alone; runtime/runner.py decides which steps
        self.prompt_rows = max(self.max_rows, int(prompt_rows or 0))
        # the largest step the server plans (None: any), up to which long-step graphs are captured
        self.step_rows = None if step_rows is None else int(step_rows)
        self.device = model.embed.device
        if graphs and self.device.type != "cuda":
            raise UsageError("CUDA graphs need the model on a CUDA device")
        self.graphs = bool(graphs)
        self.buckets = buckets(self.max_rows)
        # the prompt steps' bucket sizes; ``prompt_buckets``: those with graphs (the runner sends
        # prompt steps only while there are any; a TP worker whose capture failed still takes its
        # rank 0's, without a graph)
        self._prompt_ladder = [b for b in buckets(self.prompt_rows) if b > self.max_rows]
        self.prompt_buckets = list(self._prompt_ladder)
        self._attend = attention_fn(self.device)
        self._attend_mla, self._dsa_scores, self._dsa_topk = mla_attention_fn(self.device)
        self._fused = None
        from exl3tools.runtime import fused_step, invariance

        if fused_step.resolve(fused, self.device):
            if fused_step.supports(model):
                self._fused = fused_step.FusedGqaStep(model, pool)
            elif fused_step.supports_mla(model) and preview.on_cuda("fused_mla", self.device):
                self._fused = fused_step.FusedMlaStep(model, pool)
        # steps past the prompt buckets through the fused glue, eagerly (``long_step``; on CUDA
        # unless EXL3TOOLS_LONG_STEPS=0): GQA models only (MLA's prompt attention is its own)
        self.long_steps = (self._fused is not None and not self._fused.mla and preview.on_cuda("long_steps", self.device)
                           and not invariance.on())
        self._init_long()            # the long-step graphs' buckets (runtime/long_steps.py)
        # the eager forward's glue (the fused_eager preview): CausalLM.forward's ``body``, or None
        self.eager_body = self._fused.eager if self._fused is not None and preview.switched_on("fused_eager") else None
        if invariance.on():
            if self._fused is None or self._fused.mla or self.device.type != "cuda":
                raise UsageError("batch-invariant serving needs a GQA model (llama, qwen3_moe, glm4_moe) on CUDA "
                                 "with the fused decode step (EXL3TOOLS_FUSED not 0)")
            self._attend = invariant_attention(self._attend, self.max_blocks * pool.block_size)
        dev = self.device
        with torch.inference_mode():
            self.inputs = torch.zeros(N_INPUTS, self.prompt_rows, dtype=torch.int64, device=dev)
            self.tables = torch.zeros(self.max_seqs, self.max_blocks, dtype=torch.int32, device=dev)
            self.out = torch.zeros(self.max_rows, model.info.vocab_size, dtype=torch.float32, device=dev)
            # each row's final-normed state (what the MTP head drafts from)
            self.states = torch.zeros(self.prompt_rows, model.info.hidden_size, dtype=torch.float32, device=dev)
            # the MTP draft step (head_pool: the head's cache in blocks): its input states, output
            # states and logits
            self.head_pool = head_pool
            if head_pool is not None:
                H, V = model.info.hidden_size, model.info.vocab_size
                self.draft_in = torch.zeros(self.max_rows, H, dtype=torch.float32, device=dev)
                self.draft_states = torch.zeros(self.max_rows, H, dtype=torch.float32, device=dev)
                self.draft_out = torch.zeros(self.max_rows, V, dtype=torch.float32, device=dev)
        pin = dev.type == "cuda"
        self._host = torch.zeros(N_INPUTS, self.prompt_rows, dtype=torch.int64, pin_memory=pin)
        self._graphs: dict[tuple[int, bool, int], torch.cuda.CUDAGraph] = {}   # (bucket, sparse, width)
        self._pools: dict[str, object] = {}     # graph memory pools: "decode", "prompt" (a failed capture's is dropped)
        self._side: torch.cuda.Stream | None = None   # the captures' warm-up stream (made on first use)
        self.last_key: tuple[int, bool, int] | None = None      # the graph the last step replayed
        self.last_sparse = False                                 # whether the last step could select (DSA)
        # DSA: a step whose rows all see <= index_topk keys attends densely, so it runs a variant
        # without the indexer's scores and top-k (exact: sparse selection only starts past topk);
        # each bucket gets both graphs. None: no DSA layer, one variant.
        heads = [model.mtp.block] if head_pool is not None else []
        tops = [a.index_topk for a in (layer.attn for layer in [*model.layers, *heads])
                if isinstance(a, MLAttention) and a.index_topk]
        self.dsa_topk: int | None = min(tops) if tops else None
        # the sparse variant's block-table widths (on unless EXL3TOOLS_DSA_WIDTHS=0: runtime/preview.py)
        self.widths = (widths(self.max_blocks, pool.block_size)
                       if self.dsa_topk is not None and preview.switched_on("dsa_widths") else [self.max_blocks])
        self._copied = torch.cuda.Event() if pin else None   # the pinned inputs may be rewritten once it fired

    @property
    def graphs_captured(self) -> int:
        return len(self._graphs)

    # ------------------------------------------------------------------ table rows
    @torch.inference_mode()
    def set_blocks(self, updates: list[tuple[int, int, int]]) -> None:
        """Write (slot row, column, block id) entries of the device block tables (one copy)."""
        if not updates:
            return
        u = sampling.on_device(updates, self.device)      # no stream sync (a pageable copy would be one)
        self.tables[u[:, 0], u[:, 1]] = u[:, 2].to(torch.int32)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self, tokens: list[int], positions: list[int], slots: list[int], rows: list[int],
             device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of ``n`` rows: token ``tokens[i]`` at ``positions[i]`` goes to cache
        slot ``slots[i]``; row ``i`` reads block-table row ``rows[i]`` up to its own position. Rows
        may share a table row: a sequence's few new tokens (a short prompt, a prefix hit's tail,
        speculative drafts) are rows at consecutive positions, each attending causally, since every
        row's K/V is written before any row attends. Logits (n, vocab) float32 on the device (a
        view of a static buffer: read it before the next step; ``states[:n]``: the final-normed
        states). A prompt step (``n`` > ``max_rows``, up to ``prompt_rows``) returns the logits
        of each sequence's last row only, (sequences, vocab), in row order.
        ``device_tokens`` (n,) int64 on the device replaces ``tokens`` (the previous step's samples,
        never read back to the host first)."""
        bs, sparse, need = self._load(tokens, positions, slots, rows, device_tokens)
        self._run((), self._body, bs, sparse, need)
        return self.out[:len(tokens) if bs <= self.max_rows else len(last_rows(rows))]

    @torch.inference_mode()
    def draft(self, tokens: list[int], positions: list[int], slots: list[int], rows: list[int],
              states: torch.Tensor, device_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head over ``n`` rows as one fixed-shape step (its cache: ``head_pool``, in the
        rows' own blocks): row ``i`` is the pair (target state ``states[i]``, token ``tokens[i]``)
        at position ``positions[i]``, as ``step`` lays rows out. (final-normed states, logits) of
        every row (views of static buffers: read them before the next draft). ``device_tokens``:
        the rows' tokens on the device instead of ``tokens`` (a deeper greedy draft: the argmax of
        the depth before, never read on the host)."""
        if self.head_pool is None:
            raise UsageError("this decoder has no MTP head pool")
        n = len(tokens)
        if n > self.max_rows:
            raise UsageError(f"a draft step takes 1..{self.max_rows} rows, got {n}")
        bs, sparse, need = self._load(tokens, positions, slots, rows, device_tokens)
        self.draft_in[:n].copy_(states)
        self.draft_in[n:bs].zero_()
        self._run(("draft",), self._draft_body, bs, sparse, need)
        return self.draft_states[:n], self.draft_out[:n]

    def _run(self, tag: tuple, body, bs: int, sparse: bool, need: int) -> None:
        """Replay the graph of (tag, bucket, sparse, width), captured on first use; without graphs
        run ``body`` eagerly, reading only the table columns the longest row needs."""
        self.last_sparse = sparse
        if not self.graphs:
            body(bs, need, sparse)
            return
        key = (*tag, bs, sparse, next(w for w in self.widths if w >= need) if sparse else self.max_blocks)
        if key not in self._graphs:
            if bs <= self.max_rows:
                self.capture([bs])
            elif self.prompt_buckets:
                self._capture_prompt([bs])
        if key not in self._graphs:             # a prompt bucket whose capture failed: eagerly
            body(bs, key[-1], sparse)
            return
        self._graphs[key].replay()
        self.last_key = key

    def _load(self, tokens, positions, slots, rows, device_tokens) -> tuple[int, bool, int]:
        """Copy a step's rows into the static inputs: (bucket, sparse, table columns needed)."""
        n = len(tokens)
        if not 1 <= n <= self.prompt_rows:
            raise UsageError(f"a decode step takes 1..{self.prompt_rows} rows, got {n}")
        if max(positions) >= self.max_blocks * self.pool.block_size:
            raise UsageError(f"a position reached the block tables' width ({self.max_blocks} blocks)")
        bs = next(b for b in self.buckets + self._prompt_ladder if b >= n)
        sparse = self.dsa_topk is not None and max(positions) + 1 > self.dsa_topk
        if bs > self.max_rows and device_tokens is not None:
            raise UsageError("a prompt step takes no device tokens")
        h = self._host
        if self._copied is not None:
            self._copied.synchronize()
        h[:, n:bs] = 0                                 # padded rows: token 0 at the scratch block, nothing to read
        h[2, n:bs] = SCRATCH_BLOCK * self.pool.block_size
        h[0, :n] = torch.tensor(tokens, dtype=torch.int64)
        h[1, :n] = torch.tensor(positions, dtype=torch.int64)
        h[2, :n] = torch.tensor(slots, dtype=torch.int64)
        h[3, :n] = torch.tensor(rows, dtype=torch.int64)
        h[4, :n] = h[1, :n] + 1
        if bs > self.max_rows:                         # a prompt step: the rows whose logits are wanted
            last = last_rows(rows)
            h[5, :self.max_seqs] = 0
            h[5, :len(last)] = torch.tensor(last, dtype=torch.int64)
        self.inputs[:, :bs].copy_(h[:, :bs], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if device_tokens is not None:
            self.inputs[0, :n].copy_(device_tokens)
        return bs, sparse, -(-(max(positions) + 1) // self.pool.block_size)   # columns the longest row reads

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture the graphs of ``sizes`` (default: every bucket; the prompt buckets first),
        largest first, into one graph pool (smaller graphs reuse the blocks of larger ones;
        EXL3TOOLS_SHARED_GRAPH_POOL=0: the prompt buckets in a pool of their own)."""
        if not self.graphs:
            return
        if sizes is None:
            self._capture_long(self.long_buckets)
            self._capture_prompt(self.prompt_buckets)
        bodies = [((), self._body)] + ([(("draft",), self._draft_body)] if self.head_pool is not None else [])
        self._capture_keys([(b, v, bs) for bs in sorted(set(sizes or self.buckets), reverse=True)
                            for b in bodies for v in self._variants()])

    def _variants(self) -> list[tuple[bool, int]]:
        """(sparse, width) of each graph of a bucket: dense over the whole table; DSA's sparse
        variant once per width."""
        if self.dsa_topk is None:
            return [(False, self.max_blocks)]
        return [(False, self.max_blocks)] + [(True, w) for w in sorted(self.widths, reverse=True)]

    @torch.inference_mode()
    def _capture_keys(self, jobs: list, pool: str = "decode") -> None:
        """Capture each ((tag, body), (sparse, width), bucket) not captured yet, in order, into the
        graph pool named ``pool`` ("decode" or "prompt"; made on first use)."""
        dev = self.device
        saved = self.inputs.clone()
        self.inputs.zero_()
        self.inputs[2].fill_(SCRATCH_BLOCK * self.pool.block_size)   # warm-ups write only scratch
        if pool not in self._pools:
            self._pools[pool] = torch.cuda.graph_pool_handle()
        handle = self._pools[pool]
        # dead cycles go now, and no collection runs while capturing: one mid-capture that
        # destroyed an earlier runner's unreachable graphs (CUDAGraph reset: "operation not
        # permitted when stream is capturing") failed the capture (H200, tests/gpu, 2026-12-02);
        # torch.cuda.graph no longer collects on entry
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            for (tag, body), (sparse, width), bs in jobs:
                key = (*tag, bs, sparse, width)
                if key in self._graphs:
                    continue
                side = self._warmup_stream()
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_STEPS):
                        body(bs, width, sparse=sparse)
                torch.cuda.current_stream(dev).wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=handle):
                    body(bs, width, sparse=sparse)
                self._graphs[key] = g
        finally:
            if collecting:
                gc.enable()
            self.inputs.copy_(saved)
        torch.cuda.synchronize(dev)
        # the warm-ups' freed activations stay cached for their stream: give them back (the
        # graphs keep their own pool); H200, GLM-5 shape: 1.8 GB cached beyond the allocated after load
        torch.cuda.empty_cache()

    def _warmup_stream(self) -> torch.cuda.Stream:
        """One side stream for every capture's warm-ups: cuBLAS keeps a 32 MiB workspace per stream
        it ran on, and the caching allocator a cache per stream, so a new stream per graph held
        17 x 32 MiB on air6 and 32 x 32 MiB on the GLM-5 shape (bench/gpu_memory.py, H200)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _capture_prompt(self, sizes: list[int]) -> None:
        """Capture prompt buckets (the main step, each variant); a failure (out of memory) drops
        every prompt bucket, so such steps take the eager forward, and keeps the decode graphs."""
        if not sizes:
            return
        # a capture that fails leaves its pool unusable (the decode graphs' next capture into it
        # tripped an allocator assert, so everything ran eagerly): the pool is dropped then, and
        # later captures make a new one (graphs already captured keep theirs alive)
        pool = "decode" if preview.switched_on("shared_graph_pool") else "prompt"
        try:
            self._capture_keys([(((), self._body), v, bs) for bs in sorted(set(sizes), reverse=True)
                                for v in self._variants()], pool=pool)
        except Exception as exc:  # noqa: BLE001 - any capture failure: OOM, a Triton build, a driver refusal
            log.warning("prompt-step graphs of %s rows failed, prompt steps run eagerly: %s", sizes,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self._graphs = {k: g for k, g in self._graphs.items() if k[-3] <= self.max_rows}
            self.prompt_buckets = []     # the runner sends no more prompt steps
            self._pools.pop(pool, None)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _body(self, bs: int, width: int | None = None, sparse: bool = True) -> None:
        """One decode step of ``bs`` rows from the static inputs; device ops only, fixed shapes
        (``width``: block-table columns to read, default all; ``sparse``: DSA may select, else
        every row's context fits index_topk)."""
        m = self.model
        tokens, positions, slots, tables, ctx = self._step_inputs(bs, width)
        st = StepInputs(positions, slots, tables, ctx, self.pool, self._attend_mla, self._dsa_scores, self._dsa_topk,
                        sparse=sparse)
        if self._fused is not None:
            self._finish(self._fused(tokens, positions, slots, tables, ctx, self._attend, st), bs)
            return
        h = m.embed.index_select(0, tokens).float()
        for layer, planes in zip(m.layers, self.pool.planes, strict=True):
            a = layer.attn
            if isinstance(a, MLAttention):          # per attention kind: MLA/DSA's own step (runtime/mla.py)
                h = _mlp_static(layer, h + a.decode_static(layer.attn_norm(h), st))
                continue
            q, k, v = a.qkv(layer.attn_norm(h), positions)
            kp, vp = planes["k"], planes["v"]
            kp.index_copy_(0, slots, k.to(kp.dtype))
            vp.index_copy_(0, slots, v.to(vp.dtype))
            o = self._attend(q, self.pool.blocks(a.layer, "k"), self.pool.blocks(a.layer, "v"), tables, ctx, a.scale)
            h = _mlp_static(layer, h + a.reduce(a.o(o.reshape(bs, a.nq * a.hd))))
        self._finish(m.norm(h), bs)

    def _finish(self, hn: torch.Tensor, bs: int) -> None:
        """The step's outputs from its final-normed states: every row's logits, or in a prompt
        step (``bs`` > max_rows) those of the logit rows (input row 5; one per sequence)."""
        self.states[:bs].copy_(hn)
        if bs > self.max_rows:
            hn = hn.index_select(0, self.inputs[5, :self.max_seqs])
        self.out[:hn.shape[0]].copy_(self.model.logits(hn))

    def _step_inputs(self, bs: int, width: int | None):
        """(tokens, positions, slots, block-table rows, int32 context lengths) of the first ``bs``
        static rows, the tables cut to ``width`` columns (None: all)."""
        tokens, positions, slots, rows, ctx = self.inputs[:5, :bs]
        tables = self.tables.index_select(0, rows)
        if width is not None:
            tables = tables[:, :width]
        return tokens, positions, slots, tables, ctx.to(torch.int32)

    def _draft_body(self, bs: int, width: int | None = None, sparse: bool = True) -> None:
        """The MTP head over ``bs`` rows from the static inputs and ``draft_in`` (MTPHead.forward_many
        as device ops with fixed shapes; its attention reads and writes ``head_pool``)."""
        m, head = self.model, self.model.mtp
        tokens, positions, slots, tables, ctx = self._step_inputs(bs, width)
        st = StepInputs(positions, slots, tables, ctx, self.head_pool, self._attend_mla, self._dsa_scores,
                        self._dsa_topk, sparse=sparse)
        if self._fused is not None and getattr(self._fused, "head", None) is head and preview.switched_on("fused_draft"):
            # the decode step's fused glue around the head's block (FusedMlaStep.draft)
            hn = self._fused.draft(tokens, self.draft_in[:bs], positions, slots, tables, ctx, self._attend, st)
        else:
            emb = m.embed.index_select(0, tokens).float()
            x = head.eh_proj(torch.cat([head.enorm(emb), head.hnorm(self.draft_in[:bs])], dim=-1))
            layer = head.block
            hn = head.final_norm(_mlp_static(layer, x + layer.attn.decode_static(layer.attn_norm(x), st)))
        self.draft_states[:bs].copy_(hn)
        self.draft_out[:bs].copy_(m.logits(hn))


def _mlp_static(layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
    """A layer's residual MLP in the fixed-shape step (MoE through its sync-free forward_static)."""
    x = layer.mlp_norm(h)
    return h + (layer.mlp.forward_static(x) if isinstance(layer.mlp, MoE) else layer.mlp(x))
