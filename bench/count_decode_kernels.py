"""Kernels per fixed-shape decode step, fused glue (kernels/fused_decode.py) on vs off, on the CPU.

    TRITON_INTERPRET=1 python bench/count_decode_kernels.py [MODEL_DIR] [--batch 1,8] [--context N] [--draft]

Runs one ``PagedDecoder._body`` (decode="static": the graph body without capture) of a GQA or MLA
checkpoint (default: fixture glm4_moe-3.0bpw-mcg, 1 dense + 1 MoE layer; an MLA fixture such as
deepseek_v3-3.0bpw-3inst compares the torch loop with FusedMlaStep, EXL3TOOLS_FUSED_MLA; its
prompts stay under index_topk, so no DSA selection runs, as in a short context) and logs every aten op
it dispatches (TorchDispatchMode). Counted as a GPU kernel: every op that is not a view or an
allocation; a Triton call of kernels/fused_decode.py or expert_groups.py: 1; an EXL3 linear or grouped-expert call:
3 (our CUDA backend: had_in, gemv, had_out; the CPU reference's own ops inside are not logged).
Paged attention: 1 (its Triton kernel with one split; the CPU reference's ops not logged); MLA
attention: 2 (its split and merge kernels).
``--grouped``: the fused step's q/k/v and dense gate/up as grouped calls (EXL3TOOLS_GROUPED_PROJ):
a group counts as CUDA's CudaGroup launches it, 3 (had_in, gemv, had_out), plus at more than one
row one copy per linear of several column chunks (the gcd of the widths).
Printed per layer (a layer's row includes the next layer's attention norm; "embed" holds the
host-side input packing, the input copy and layer 0's norm; the last layer the final norm), so a
deeper model's count is the sum (GLM-4.5-Air synthetic: 1 dense + 5 MoE). Approximate where an op
is several CUDA kernels (topk, repeat_interleave); not counted: the int64 -> int32 index casts
inside the unfused path's grouped-expert calls (2 per call on CUDA; the fused path passes int32).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("EXL3TOOLS_FIXTURES", REPO.parent / "shared" / "fixtures"))
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
        "_to_copy_noop", "set_", "resize_", "is_nonzero", "item", "_local_scalar_dense"}
GEMV_KERNELS = 3


class Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0
        self.where = "step"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # aten.to is marked as a view (it may return its input), but a cast that makes a new
        # tensor is a kernel
        real = not func.is_view or (name == "to" and out is not (args[0] if args else None))
        if not self.paused and real and name not in FREE:
            self.ops[(self.where, name)] += 1
        return out


def _wrap(log: Log, fn, label: str, kernels: int):
    def run(*a, **k):
        log.paused += 1
        try:
            return fn(*a, **k)
        finally:
            log.paused -= 1
            if not log.paused:
                log.ops[(log.where, label)] += kernels
    return run


def instrument(runner, log: Log) -> None:
    from exl3tools.kernels import expert_groups, fused_decode, fused_mla

    from exl3tools.runtime.layers import DecoderLayer, GatedMLP, Linear, MoE
    from exl3tools.runtime.mla import MLAttention

    model = runner.model
    dec = runner.paged.decoder
    dec._attend = _wrap(log, dec._attend, "paged_attention", 1)
    dec._attend_mla = _wrap(log, dec._attend_mla, "mla_attention", 2)
    for name in ("embed_rmsnorm", "residual_rmsnorm", "qk_rope_store", "route", "silu_mul"):
        setattr(fused_decode, name, _wrap(log, getattr(fused_decode, name), f"triton:{name}", 1))
    from exl3tools.kernels import dsa_indexer

    real_select = dsa_indexer.select

    def select(q, w, kidx, tables, ctx, scale, topk, score_fn, topk_fn):
        n = _select_kernels(score_fn, topk_fn, tables.shape[1] * kidx.shape[1])
        return _wrap(log, real_select, "triton:dsa_select", n)(q, w, kidx, tables, ctx, scale, topk, score_fn, topk_fn)
    dsa_indexer.select = select
    expert_groups.group_pairs = _wrap(log, expert_groups.group_pairs, "triton:group_pairs", 1)
    for name in ("latent_store", "rope_heads", "index_key_store", "index_queries"):
        setattr(fused_mla, name, _wrap(log, getattr(fused_mla, name), f"triton:{name}", 1))

    def lin(x: Linear):
        x.fn = _wrap(log, x.fn, "exl3_linear", GEMV_KERNELS)

    def mlp(m: GatedMLP):
        for p in (m.gate, m.up, m.down):
            lin(p)
    lin(model.head)

    def block(layer) -> tuple[list, str]:
        assert isinstance(layer, DecoderLayer)
        a = layer.attn
        if isinstance(a, MLAttention):
            ind = getattr(a.indexer, "wq_b", None)
            projs = [p for p in (a.q_a, a.q_b, a.q_proj, a.kv_a, a.o, ind) if p is not None]
        else:
            projs = [a.q, a.k, a.v, a.o]
        for p in projs:
            lin(p)
        kind = "moe" if isinstance(layer.mlp, MoE) else "dense"
        if kind == "moe":
            g = layer.mlp.grouped()
            merged = dec._fused._with_shared(layer.mlp) if dec._fused is not None else None
            _wrap_experts(log, g)
            if merged is not None:
                _wrap_experts(log, merged)
            if layer.mlp.shared is not None:
                mlp(layer.mlp.shared)
        else:
            mlp(layer.mlp)
        return projs, kind
    for i, layer in enumerate(model.layers):
        projs, kind = block(layer)
        _tag(log, projs[0], f"layer{i}:{kind}")
    head = getattr(model, "mtp", None)
    if head is not None:          # the MTP head (--draft): its input projection, then its block
        block(head.block)
        lin(head.eh_proj)
        _tag(log, head.eh_proj, "mtp")
    _tag(log, model.head, "head")


def _select_kernels(score_fn, topk_fn, width: int) -> int:
    """Launches of one DSA selection on CUDA (kernels/dsa_indexer.select, its fp16 key plane): the
    scores, then one top-k program a row, or the chunked top-k's memset and three passes, the
    first inside the tensor-core scores kernel."""
    from exl3tools.kernels import dsa_indexer as di

    from exl3tools.runtime import preview

    if not di._chunked_at(topk_fn, width):
        return 2
    return 4 if score_fn is di.paged_scores_tc and preview.switched_on("dsa_fused_select") else 5


def _group_calls(log: Log):
    """LinearGroup.__call__ counted as CudaGroup's launches (its linears' own counts paused)."""
    import math

    from exl3tools.runtime.layers import LinearGroup

    real = LinearGroup.__call__

    def call(self, x):
        ns = [m.out_pad for m in self.linears]
        c = math.gcd(*ns)
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        copies = sum(n // c > 1 for n in ns) if rows > 1 else 0
        return _wrap(log, lambda v: real(self, v), "exl3_group", GEMV_KERNELS + copies)(x)
    return LinearGroup, real, call


def _wrap_experts(log: Log, g: dict) -> None:
    for key, obj in list(g.items()):
        if hasattr(obj, "slots"):
            wrapped = type("Counted", (), {})()
            wrapped.slots = _wrap(log, obj.slots, "exl3_experts", GEMV_KERNELS)
            if hasattr(obj, "tiles"):
                wrapped.tiles = _wrap(log, obj.tiles, "exl3_experts", GEMV_KERNELS)
            g[key] = wrapped


def _tag(log: Log, lin, where: str) -> None:
    """Attribute what follows to ``where`` from the first call of ``lin`` on (a layer's q
    projection, the head): per layer, its attention norm counts with the layer before."""
    fn = lin.fn

    def tagged(*a, **k):
        log.where = where
        return fn(*a, **k)
    lin.fn = tagged


def count(model_dir: Path, fused: bool, batch: int, grouped: bool = False, context: int = 9,
          draft: bool = False) -> collections.Counter:
    """The kernels of one decode step of ``batch`` rows after a ``context``-token prompt each;
    ``draft``: of one MTP draft step of sequence 0 instead (the head over one row)."""
    from exl3tools.runtime.runner import load_runner

    os.environ["EXL3TOOLS_FUSED"] = "1" if fused else "0"
    os.environ["EXL3TOOLS_FUSED_MLA"] = "1" if fused else "0"
    os.environ["EXL3TOOLS_GROUPED_PROJ"] = "1" if grouped else "0"
    r = load_runner(model_dir, max_context=max(64, context + 8), max_cache_tokens=max(512, batch * (context + 24)),
                    max_num_seqs=max(batch, 1), block_size=16, decode="static", speculative_tokens=int(draft))
    assert (r.paged.decoder._fused is not None) == fused
    ids = list(range(batch))
    for s in ids:
        r.add_sequence(s)
        r.step([(s, [3 + t % 200 for t in range(context)])])
    r.step([(s, [5]) for s in ids])
    from exl3tools.kernels import dsa_indexer, expert_groups, fused_decode, fused_mla

    saved, saved_groups, saved_mla = dict(vars(fused_decode)), expert_groups.group_pairs, dict(vars(fused_mla))
    saved_select = dsa_indexer.select
    log = Log()
    cls, real_call, call = _group_calls(log)
    try:
        instrument(r, log)
        if r.paged.decoder._fused is not None:
            r.paged.decoder._fused._groups.clear()    # rebuilt from the instrumented linears
        cls.__call__ = call
        with torch.inference_mode(), log:
            log.where = "embed"
            if draft:
                r.draft(0, 7, 1, lambda row: int(row.argmax()))
            else:
                r.step([(s, [7]) for s in ids])
    finally:
        dsa_indexer.select = saved_select
        cls.__call__ = real_call
        vars(fused_decode).update(saved)
        vars(fused_mla).update(saved_mla)
        expert_groups.group_pairs = saved_groups
        r.close()
    return log.ops


def summary(ops: collections.Counter) -> dict[str, int]:
    out: dict[str, int] = collections.Counter()
    for (where, _), n in ops.items():
        out[where] += n
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(FIXTURES / "glm4_moe-3.0bpw-mcg" / "model"))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--detail", action="store_true", help="print every op name with its count")
    ap.add_argument("--grouped", action="store_true", help="the fused step with q/k/v and gate/up grouped")
    ap.add_argument("--context", type=int, default=9,
                    help="prompt tokens before the counted step; past a DSA model's index_topk the selection runs")
    ap.add_argument("--draft", action="store_true",
                    help="count one MTP draft step (the head over one row; an MTP model) instead of a decode step")
    a = ap.parse_args(argv)
    for B in [int(x) for x in a.batch.split(",")]:
        res = {f: count(Path(a.model), f, B, grouped=f and a.grouped, context=a.context, draft=a.draft)
               for f in (False, True)}
        print(f"batch {B}: kernels per decode step (torch loop -> fused)")
        wheres = sorted({w for ops in res.values() for w, _ in ops}, key=lambda w: (w != "embed", w))
        for w in wheres:
            un = sum(n for (x, _), n in res[False].items() if x == w)
            fu = sum(n for (x, _), n in res[True].items() if x == w)
            print(f"  {w:16s} {un:4d} -> {fu:4d}")
        print(f"  {'total':16s} {sum(res[False].values()):4d} -> {sum(res[True].values()):4d}")
        if a.detail:
            for f in (False, True):
                print(f"  --- {'fused' if f else 'torch loop'}")
                for (w, name), n in sorted(res[f].items()):
                    print(f"    {w:16s} {name:28s} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
