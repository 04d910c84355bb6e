"""The GQA layers of the fixed-shape decode step with the fused glue kernels (kernels/fused_decode.py);
FusedMlaStep runs the same glue around MLA/DSA attention (the default on CUDA since 2026-12-03;
EXL3TOOLS_FUSED_MLA=0 opts out).

Same math as ``PagedDecoder._body``'s torch loop, in fewer launches per layer:

    h, x = embedding rows, rmsnorm(h)                        (layer 0's attn_norm, one kernel)
    cos, sin = rope_tables(positions)                       (torch, once per step)
    per layer:  q, k, v = projections(x)
                q = qk_rope_store(q, k, v -> paged planes)   (q/k norm, RoPE, both K/V writes)
                o = paged attention; d = o_proj(o)
                x = residual_rmsnorm(h += d; mlp_norm)
                MLP: dense  -> d = down(silu_mul(gate(x), up(x)))
                     MoE    -> route (one kernel: choice, weights, index arrays; the shared expert
                               as one more pair per token), gate+up grouped, silu_mul, down grouped
                               (2+ tokens: the pairs in one tile per expert,
                               kernels/expert_groups.py, so each expert decodes once)
                x = residual_rmsnorm(h += d + sum_j w_j y_j; next attn_norm, or the final norm)

so the residual adds, the routed sum and the norms are one kernel per norm. MoE layers whose
outputs are all-reduced (TP) keep ``MoE.forward_static`` and only the residual/norm fusion; the
tiled expert path (wide batches) keeps its bookkeeping and takes the fused routing.

The switch: ``PagedDecoder(fused=...)``; None: on CUDA unless ``EXL3TOOLS_FUSED=0`` (runtime/preview.py
OPT_OUTS), on the CPU only with ``EXL3TOOLS_FUSED=1`` under the Triton interpreter (slow: the tests
that check it ask for it); ``resolve`` decides.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from exl3tools.errors import UsageError
from exl3tools.kernels import expert_groups as eg
from exl3tools.kernels import fused_decode as fk
from exl3tools.runtime import invariance, preview
from exl3tools.runtime.layers import (
    MOE_TILES_MIN_SLOTS,
    Attention,
    DecoderLayer,
    GatedMLP,
    LinearGroup,
    MoE,
    _identity,
    expert_tiles,
    tile_rows,
)

# pairs from which the pair-order tiles run (self.pair_tiles: batch-invariant runs, EXL3TOOLS_PAIR_TILES)
PAIR_TILES_MIN_SLOTS = int(os.environ.get("EXL3TOOLS_PAIR_TILES_MIN", "64"))


def resolve(fused: bool | None, device: torch.device) -> bool:
    """Whether the decode step of a model on ``device`` runs the fused kernels."""
    if fused is None:
        return fk.available(device) and preview.on_cuda("fused", torch.device(device))
    if fused and not fk.available(device):
        raise UsageError("the fused decode kernels need triton and a CUDA device (or TRITON_INTERPRET=1)")
    return bool(fused)


def supports(model) -> bool:
    """Whether every layer is a GQA block this step runs (other attention kinds: the torch loop)."""
    return all(isinstance(layer, DecoderLayer) and type(layer.attn) is Attention
               and isinstance(layer.mlp, (GatedMLP, MoE)) for layer in model.layers)


def _dev(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device, torch.float32).contiguous()


class FusedGqaStep:
    """``__call__(tokens, positions, slots, tables, ctx, attend) -> x``: every layer of ``model`` on
    the step's tokens, returning the final-normed states for the head;
    ``attend``: the paged decode attention (kernels.paged_attention contract)."""

    mla = False

    def __init__(self, model, pool):
        self.model, self.pool = model, pool
        dev = model.embed.device
        # the MTP head's block (an MLA model's) takes the same glue in its draft steps (``draft``)
        head = getattr(model, "mtp", None) if self.mla else None
        self.head = head if head is not None and mla_block(head.block) else None
        blocks = list(model.layers) + ([self.head.block] if self.head is not None else [])
        for layer in blocks:                             # norms, rope, routers on the device once
            for n in (layer.attn_norm, layer.mlp_norm):
                n.weight = _dev(n.weight, dev)
            self._prepare_attention(layer.attn, dev)
            if isinstance(layer.mlp, MoE):
                layer.mlp.router, layer.mlp.bias = _dev(layer.mlp.router, dev), _dev(layer.mlp.bias, dev)
        if self.head is not None:
            for n in (self.head.enorm, self.head.hnorm, self.head.final_norm):
                n.weight = _dev(n.weight, dev)
        # the centred fp16 bias of each MoE that picks its experts as exllamav3 does (computed here,
        # not while a graph is captured)
        self._fp16_bias = {id(m): _dev(m.choice_bias(), dev) for m in (layer.mlp for layer in blocks)
                           if getattr(m, "fp16_choice", False)}
        model.norm.weight = _dev(model.norm.weight, dev)
        self.norms = [layer.attn_norm for layer in model.layers[1:]] + [model.norm]
        self._shared: dict[int, dict | None] = {}
        # q/k/v and a dense MLP's gate/up as one grouped call each (cuda_group.CudaGroup, 6 launches
        # fewer a layer; the default, EXL3TOOLS_GROUPED_PROJ=0 opts out): off, each linear alone
        self.grouped = preview.switched_on("grouped_proj")
        self._groups: dict[int, LinearGroup] = {}
        # the shared expert inside the routed experts' grouped calls ("0": apart; for measurements)
        self.shared_in_group = os.environ.get("EXL3TOOLS_FUSED_SHARED", "1") != "0"
        self.invariant = invariance.on()
        # an MLA model's router: both logits from one GEMM (runtime/preview.py router_one_gemm)
        self.router_one_gemm = preview.switched_on("router_one_gemm")
        # a tensor-parallel rank's MoE through the routing kernel too (_moe_reduced)
        self.fused_tp_moe = preview.switched_on("fused_tp_moe")
        # MoE rows in expert-sorted tiles, back in pair order (the invariant mode's path; a preview otherwise)
        self.pair_tiles = self.invariant or preview.switched_on("pair_tiles")
        # 2+ tokens: one tile per expert (kernels/expert_groups.py; the default, EXL3TOOLS_EXPERT_GROUPS=0 opts out)
        self.expert_groups = preview.switched_on("expert_groups") and not self.pair_tiles
        # steps of up to this many pairs take them (past it: _tiles_sum); wider with the preview
        self.max_pairs = eg.WIDE_MAX_PAIRS if preview.switched_on("wide_groups") else eg.MAX_PAIRS

    @staticmethod
    def _prepare_attention(a, dev) -> None:
        for n in (a.q_norm, a.k_norm):
            if n is not None:
                n.weight = _dev(n.weight, dev)
        a.inv_freq = _dev(a.inv_freq, dev)

    def __call__(self, tokens, positions, slots, tables, ctx, attend, st=None) -> torch.Tensor:
        """``st``: PagedDecoder's StepInputs (what MLAttention.decode_static reads; FusedMlaStep)."""
        layers = self.model.layers
        first = layers[0].attn_norm
        h, x = fk.embed_rmsnorm(self.model.embed, tokens, first.weight, first.eps)
        rope: dict[int, tuple] = {}       # cos/sin per distinct inv_freq (one for these models)
        for layer, nxt in zip(layers, self.norms, strict=True):
            x = self._layer(layer, nxt, h, x, rope, positions, slots, tables, ctx, attend, st)
        return x

    def eager(self, tokens: torch.Tensor, batch) -> torch.Tensor:
        """An eager step's final-normed states (CausalLM.forward's ``body``): this step's glue with
        each layer's own attention over ``batch`` (a layers.Batch of the sequences' caches: the
        prompt kernels, DSA's selection, any rows and history), for steps no fixed-shape step
        takes (every row's logits, MLA prompt chunks); the fused_eager switch."""
        layers = self.model.layers
        first = layers[0].attn_norm
        h, x = fk.embed_rmsnorm(self.model.embed, tokens, first.weight, first.eps)
        for layer, nxt in zip(layers, self.norms, strict=True):
            x = self._rest(layer, nxt, h, layer.attn(x, batch))
        return x

    def _layer(self, layer, nxt, h, x, rope, positions, slots, tables, ctx, attend, st) -> torch.Tensor:
        """One block on residual rows ``h`` (updated in place) and their attention-normed ``x``:
        the block's output normed by ``nxt`` (the next block's attention norm, or the final one)."""
        return self._rest(layer, nxt, h, self._attend_layer(layer.attn, x, rope, positions, slots, tables, ctx,
                                                             attend, st))

    def _rest(self, layer, nxt, h, d) -> torch.Tensor:
        """A block after its attention's output ``d``: the residual add and MLP norm, the MLP, the
        residual add and ``nxt``'s norm (one kernel each norm)."""
        both = None
        if self.router_one_gemm and id(layer.mlp) in self._fp16_bias and self._routes_here(layer.mlp):
            x, both = fk.residual_rmsnorm(h, layer.mlp_norm.weight, layer.mlp_norm.eps, delta=d, with_fp16=True)
        else:
            x = fk.residual_rmsnorm(h, layer.mlp_norm.weight, layer.mlp_norm.eps, delta=d)
        d, y, wk, y_rows = self.mlp(layer.mlp, x, both)
        return fk.residual_rmsnorm(h, nxt.weight, nxt.eps, delta=d, y=y, wk=wk, y_rows=y_rows)

    def draft(self, tokens, states, positions, slots, tables, ctx, attend, st) -> torch.Tensor:
        """The MTP head's final-normed states of rows (target state ``states[i]``, token
        ``tokens[i]``): MTPHead.forward_many's math with this step's glue (the embedding row and
        its norm in one kernel, each norm and residual add in one, the block's MLA through the
        fused kernels and its MoE through the routing kernel and grouped experts), where the torch
        draft body runs each RMSNorm, RoPE and router as ~150 small torch ops. ``st``: the draft's
        StepInputs (the head's pool)."""
        head = self.head
        _, xe = fk.embed_rmsnorm(self.model.embed, tokens, head.enorm.weight, head.enorm.eps)
        xs = fk.residual_rmsnorm(states, head.hnorm.weight, head.hnorm.eps)     # states not written
        h = head.eh_proj(torch.cat([xe, xs], dim=-1)).float()
        block = head.block
        x = fk.residual_rmsnorm(h, block.attn_norm.weight, block.attn_norm.eps)
        return self._layer(block, head.final_norm, h, x, {}, positions, slots, tables, ctx, attend, st)

    def _attend_layer(self, a, x, rope, positions, slots, tables, ctx, attend, st) -> torch.Tensor:
        if id(a.inv_freq) not in rope:
            rope[id(a.inv_freq)] = fk.rope_tables(positions, a.inv_freq)
        return self.attention(a, x, rope[id(a.inv_freq)], slots, tables, ctx, attend)

    def attention(self, a, x, rope, slots, tables, ctx, attend) -> torch.Tensor:
        """o_proj of the paged attention of the rows of ``x`` (their K/V written first);
        ``rope``: (cos, sin) of the step's positions (kernels.fused_decode.rope_tables)."""
        planes = self.pool.planes[a.layer]
        qn = kn = None
        eps = 1e-6
        if a.q_norm is not None and a.k_norm is not None:
            qn, kn, eps = a.q_norm.weight, a.k_norm.weight, a.q_norm.eps
        q = fk.qk_rope_store(*self._project(a, (a.q, a.k, a.v), x), *rope, slots, a.rdim, planes["k"], planes["v"],
                             qn, kn, eps)
        o = attend(q, self.pool.blocks(a.layer, "k"), self.pool.blocks(a.layer, "v"), tables, ctx, a.scale)
        return a.reduce(a.o(o.reshape(x.shape[0], a.nq * a.hd)))

    @staticmethod
    def _fused_moe(mlp) -> bool:
        """Whether ``mlp`` takes the fused MoE path of ``mlp`` (else MoE.forward_static)."""
        return isinstance(mlp, MoE) and mlp.reduce is _identity and bool(mlp.experts)

    @staticmethod
    def _reduced_moe(mlp) -> bool:
        """Whether ``mlp`` is a tensor-parallel rank's MoE (its outputs all-reduced) with experts
        here (``--moe tp``: a slice of each; ``--moe ep``: whole experts, the routing kernel's
        ``lut`` giving the others weight 0, as MoE.forward_static does), which ``_moe_reduced`` runs."""
        return isinstance(mlp, MoE) and mlp.reduce is not _identity and bool(mlp.experts)

    def mlp(self, mlp, x, both: torch.Tensor | None = None):
        """(delta, y, wk, y_rows): the MLP's output as ``delta`` plus, for routed experts, their rows
        ``y`` (T * top_k, >= H; or any rows, pair p's at y_rows[p]) and weights ``wk`` (T * top_k,),
        for residual_rmsnorm to sum. ``both``: x over its fp16-rounded rows (residual_rmsnorm's
        with_fp16), where the router chooses from fp16 activations: both logits in one GEMM."""
        if isinstance(mlp, GatedMLP):
            return mlp.reduce(mlp.down(fk.silu_mul(*self._project(mlp, (mlp.gate, mlp.up), x)))), None, None, None
        if self._fused_moe(mlp):
            return self._moe(mlp, x, both)
        if self.fused_tp_moe and self._reduced_moe(mlp):
            return self._moe_reduced(mlp, x, both), None, None, None
        return mlp.forward_static(x), None, None, None

    def _routes_here(self, mlp) -> bool:
        """Whether ``mlp`` goes through the routing kernel (``_moe``, or ``_moe_reduced`` at TP > 1)."""
        return self._fused_moe(mlp) or (self.fused_tp_moe and self._reduced_moe(mlp))

    def _moe_reduced(self, mlp: MoE, x: torch.Tensor, both: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor-parallel rank's MoE output, reduced: the routing kernel and grouped experts as
        on one rank, the local rows' weighted sum (kernels/moe_combine.py), then MoE._finish's
        order: a sharded shared expert's part added before the all-reduce, a replicated one after
        (where MoE.forward_static routes in ~15 torch ops and decodes one row per pair)."""
        from exl3tools.kernels import moe_combine

        T, H = x.shape
        d, y, wk, y_rows = self._moe(mlp, x, both, with_shared=False)
        out = torch.zeros(T, H, dtype=torch.float32, device=x.device) if d is None else d.float()
        if y is not None:
            P = mlp.top_k
            inv = y_rows.view(T, P) if y_rows is not None else \
                torch.arange(T * P, dtype=torch.int32, device=x.device).view(T, P)
            (moe_combine.combine if x.is_cuda else moe_combine.combine_reference)(out, y, inv, wk.view(T, P))
        sh = mlp.shared
        shared = None if sh is None else sh.down(fk.silu_mul(*self._project(sh, (sh.gate, sh.up), x)))
        if shared is not None and sh.sharded:
            out = out + shared
        out = mlp.reduce(out)
        if shared is not None and not sh.sharded:
            out = out + shared
        return out

    def _moe(self, mlp: MoE, x: torch.Tensor, both: torch.Tensor | None, with_shared: bool = True):
        """``mlp``'s (delta, y, wk, y_rows) on one rank's experts; ``with_shared`` False: the
        routed experts alone (``_moe_reduced`` adds the shared one around the reduce)."""
        T, H = x.shape
        g = mlp.grouped()
        g["lut"] = g["lut"].to(x.device)
        # batch-invariant runs: the router's GEMM at a fixed shape; never _tiles_sum (it sums a
        # token's experts in another order than residual_rmsnorm), tiles in pair order instead
        choice = None
        if self.invariant:
            logits = invariance.rows_mm(x, mlp.router.t())
        elif both is not None:
            logits, choice = (both @ mlp.router.t()).split(T)
        else:
            logits = x @ mlp.router.t()
        S = T * mlp.top_k
        tiled = S >= MOE_TILES_MIN_SLOTS and mlp._tiled() and not self.pair_tiles
        by_expert = self.expert_groups and not self.pair_tiles and T > 1
        merged = self._with_shared(mlp) if with_shared and (by_expert or not tiled) else None
        NE = len(mlp.experts) + (merged is not None)
        g_tiles = "gate_up" in g and hasattr(g["down_proj"], "tiles")     # g's calls take tiles
        by_expert = by_expert and T * (mlp.top_k + (merged is not None)) <= self.max_pairs and (merged is not None or g_tiles)
        tiled = tiled and not by_expert
        if merged is not None and not tiled:          # the shared expert as one more pair per token
            r = self._route(mlp, x, logits, g["lut"], shared=True, choice=choice)
            xp = F.pad(x, (0, g["in_pad"] - H)) if g["in_pad"] > H else x
            S = T * (mlp.top_k + 1)
            if by_expert:
                y, rows = _by_expert(merged, xp, r, mlp.top_k + 1, NE)
                return None, y, r["wk"], rows
            if self.pair_tiles and S >= PAIR_TILES_MIN_SLOTS:
                return None, _pairs_by_tiles(merged, xp, r, S, mlp.top_k + 1, NE), r["wk"], None
            gu = merged["gate_up"].slots(xp, r["gate_src"], r["gate_exp"])
            return None, _down(merged["down_proj"], gu, S, r["down_exp"]), r["wk"], None
        r = self._route(mlp, x, logits, g["lut"], choice=choice)
        sh = mlp.shared if with_shared else None
        shared = None if sh is None else sh.down(fk.silu_mul(sh.gate(x), sh.up(x)))
        if tiled:
            routed = mlp._tiles_sum(x, g, r["loc"], r["w"])
            return (routed if shared is None else routed + shared), None, None, None
        xp = F.pad(x, (0, g["in_pad"] - H)) if g["in_pad"] > H else x
        if by_expert:
            y, rows = _by_expert(g, xp, r, mlp.top_k, NE)
            return shared, y, r["wk"], rows
        if self.pair_tiles and S >= PAIR_TILES_MIN_SLOTS and g_tiles:
            return shared, _pairs_by_tiles(g, xp, r, S, mlp.top_k, len(mlp.experts)), r["wk"], None
        if g_tiles:
            return shared, _down(g["down_proj"], g["gate_up"].slots(xp, r["gate_src"], r["gate_exp"]), S,
                                 r["down_exp"]), r["wk"], None
        if "gate_up" in g:
            gu = g["gate_up"].slots(xp, r["gate_src"], r["gate_exp"])
            act = fk.silu_mul(gu[:S], gu[S:])
        else:
            src, exp = r["gate_src"][:S], r["down_exp"]
            act = fk.silu_mul(g["gate_proj"].slots(xp, src, exp), g["up_proj"].slots(xp, src, exp))
        down = g["down_proj"]
        if hasattr(down, "tiles"):     # one row per tile, rows in pair order: no source index
            y = down.tiles(act, None, r["down_exp"], r["down_exp"], 1)
        else:
            y = down.slots(act, torch.arange(S, device=x.device), r["down_exp"])
        return shared, y, r["wk"], None

    def _route(self, mlp: MoE, x: torch.Tensor, logits: torch.Tensor, lut: torch.Tensor, shared: bool = False,
               choice: torch.Tensor | None = None) -> dict:
        """fk.route of ``mlp``'s router logits; an MoE that picks from fp16-rounded activations
        (arch.deepseek_v3.Fp16ChoiceMoE: MLA models) gets those logits (``choice``, or made here)
        and its centred fp16 bias."""
        bias = mlp.bias
        if id(mlp) in self._fp16_bias:
            bias = self._fp16_bias[id(mlp)]
            if choice is None:
                choice = x.half().float() @ mlp.router.t()
        else:
            choice = None
        return fk.route(logits, mlp.top_k, mlp.routing, mlp.norm, mlp.scaling, bias, lut, len(mlp.experts),
                        shared=shared, choice_logits=choice)

    def _project(self, owner, linears: tuple, x: torch.Tensor) -> list[torch.Tensor]:
        """Each of ``linears`` (which read the same x) applied to x: as one LinearGroup of
        ``owner``'s, built on first use, where grouping is on."""
        if not self.grouped:
            return [lin(x) for lin in linears]
        g = self._groups.get(id(owner))
        if g is None:
            g = self._groups[id(owner)] = LinearGroup(list(linears))
        return g(x)

    def _with_shared(self, mlp: MoE) -> dict | None:
        """{"gate_up", "down_proj"}: the held experts plus the shared expert as grouped projections
        (gate_up: [gates, shared gate, ups, shared up]; down: [downs, shared down]) over the
        tensors the linears already hold (no copy on the GPU), so the shared expert rides in the
        routed calls: 6 launches fewer per MoE layer. None where it cannot: no shared expert, a
        cut one, shapes, codebooks or K that differ from the routed experts', a backend without
        tiles or without resident tensors."""
        key = id(mlp)
        if key not in self._shared:
            self._shared[key] = _group_with_shared(mlp) if self.shared_in_group else None
        return self._shared[key]


class FusedMlaStep(FusedGqaStep):
    """The fused glue around MLA/DSA attention (DeepSeek-V3, GLM-5; the default on CUDA,
    EXL3TOOLS_FUSED_MLA=0 opts out): the embedding + first norm, each residual add + RMSNorm (the
    routed experts' weighted sum included) and the MoE (routing kernel with Fp16ChoiceMoE's fp16 pick, grouped experts, the
    shared expert in their calls) are FusedGqaStep's; the attention is ``MLAttention.decode_static``
    with the step's RoPE table (its norms, RoPEs and latent writes as kernels/fused_mla.py's
    kernels). ``st``: PagedDecoder's StepInputs."""

    mla = True

    @staticmethod
    def _prepare_attention(a, dev) -> None:
        a._to(dev)                                   # w_uk, w_uv, inv_freq
        for n in (a.q_a_norm, a.kv_a_norm):
            if n is not None:
                n.weight = _dev(n.weight, dev)
        ind = a.indexer
        if ind is not None:
            ind._to(dev)
            # one inv_freq object (each _to made its own device copy): MLAttention._index_rope then
            # lets the step's RoPE table serve the indexer's keys and queries too
            if torch.equal(ind.inv_freq, a.inv_freq):
                ind.inv_freq = a.inv_freq

    def _attend_layer(self, a, x, rope, positions, slots, tables, ctx, attend, st) -> torch.Tensor:
        key = (id(a.inv_freq), a.attn_factor)     # one (cos, sin) per step for the layers sharing it
        if key not in rope:
            cos, sin = fk.rope_tables(positions, a.inv_freq)
            rope[key] = (cos * a.attn_factor, sin * a.attn_factor)
        return a.decode_static(x, st, rope_cs=rope[key], project=self._project)


def mla_block(layer) -> bool:
    """Whether ``layer`` is an MLA block (MLAttention) with a dense or MoE MLP."""
    from exl3tools.runtime.mla import MLAttention

    return isinstance(layer, DecoderLayer) and isinstance(layer.attn, MLAttention) and isinstance(layer.mlp, (GatedMLP, MoE))


def supports_mla(model) -> bool:
    """Whether every layer is an MLA block: FusedMlaStep's."""
    return all(mla_block(layer) for layer in model.layers)


def _down(down, gu: torch.Tensor, N: int, row_exp: torch.Tensor, tile_exp: torch.Tensor | None = None,
          rows: int = 1, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The down projection of N rows from their gate+up output ``gu`` (2N rows: gates, then ups),
    in tiles of ``rows`` rows of experts ``tile_exp`` with ``counts`` real rows (default: one row
    per tile, pair order): silu(gate) * up inside its input pass where the backend can
    (``fused_act``: EXL3TOOLS_ACT_INPUT, cuda_exl3), else through silu_mul first."""
    tile_exp = row_exp if tile_exp is None else tile_exp
    if getattr(down, "fused_act", False):
        return down.tiles(gu, None, row_exp, tile_exp, rows, counts=counts, act_rows=N)
    return down.tiles(fk.silu_mul(gu[:N], gu[N:]), None, row_exp, tile_exp, rows, counts=counts)


def _by_expert(proj: dict, xp: torch.Tensor, r: dict, P: int, NE: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, y_rows): the gate+up and down calls of ``proj`` over the step's pairs in one tile per
    expert (kernels/expert_groups.py: each expert's weights decoded once, whatever its pairs);
    y in tile order, pair p's row at y_rows[p] (residual_rmsnorm reads them there). ``r``:
    fk.route's output (P pairs per token over NE experts, up at +NE)."""
    gp = eg.group_pairs(r["down_exp"], P, NE)
    NT, R = gp["tiles"], gp["rows"]
    N = NT * R
    gu = proj["gate_up"].tiles(xp, gp["row_src"], gp["row_exp"], gp["tile_exp"], R, counts=gp["tile_n"])
    y = _down(proj["down_proj"], gu, N, gp["row_exp"][:N], gp["tile_exp"][:NT], R, gp["tile_n"][:NT])
    return y, gp["pair_row"]


def _pairs_by_tiles(merged: dict, xp: torch.Tensor, r: dict, S: int, P: int, NE: int) -> torch.Tensor:
    """The merged experts' rows of a batch-invariant step, in pair order as the slots path gives
    them, but computed in expert-sorted tiles (one weight decode per tile, not per pair): with the
    invariant kernels a row's result does not depend on its tile (tests/gpu/test_batch_invariance_gpu.py),
    so this equals the slots path bit for bit. ``r``: fk.route's output with the shared pair;
    P pairs per token, NE merged experts (the shared one last)."""
    R = tile_rows(S, NE)
    tile_exp, row_exp, slot, valid = expert_tiles(r["down_exp"].long(), NE, R)
    tok = torch.where(valid, slot, 0) // P
    up_tiles = torch.where(tile_exp >= 0, tile_exp + NE, -1)
    gu = merged["gate_up"].tiles(xp, torch.cat([tok, tok]), torch.cat([row_exp, row_exp + NE]),
                                 torch.cat([tile_exp, up_tiles]), R)
    N = row_exp.shape[0]
    y = merged["down_proj"].tiles(fk.silu_mul(gu[:N], gu[N:]), None, row_exp, tile_exp, R)
    # each pair's tile row (padding rows all point at entry S, dropped): no host sync, graph-safe
    at = torch.zeros(S + 1, dtype=torch.int64, device=xp.device).scatter_(0, slot, torch.arange(N, device=xp.device))
    return y.index_select(0, at[:S])


def _group_with_shared(mlp: MoE) -> dict | None:
    from exl3tools.kernels.dispatch import make_experts

    sh = mlp.shared
    if sh is None or sh.sharded or not mlp.experts:
        return None
    held = sorted(mlp.experts)
    fields = mlp._resident_fields(held)
    if fields is None:
        return None
    extra = {}
    for p, lin in (("gate_proj", sh.gate), ("up_proj", sh.up), ("down_proj", sh.down)):
        t = getattr(lin.fn, "device_tensors", None)
        if t is None or lin.codebook is None:
            return None
        extra[p] = (t, lin.codebook, lin.k_bits)
    out = {}
    for name, parts in (("gate_up", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        tensors, kinds = [], set()
        for p in parts:
            t, cb, kb = extra[p]
            tensors += [f.tensors for f in fields[p]] + [t]
            kinds |= {(f.codebook, f.k_bits) for f in fields[p]} | {(cb, kb)}
        shapes = {tuple(t["trellis"].shape) for t in tensors}
        if len(kinds) != 1 or len(shapes) != 1 or len({"bias" in t for t in tensors}) != 1:
            return None
        (cb, kb), = kinds
        out[name] = make_experts(tensors, cb, kb, mlp.device, mlp.backend)
        if not hasattr(out[name], "tiles"):
            return None
    return out
