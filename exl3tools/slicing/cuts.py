"""Where each module of an EXL3 checkpoint is cut for tensor parallelism (docs/rank-slice.md §3).

Pure functions of the config and the tensor index: SLICE_RULES gives every module a role, the split
arithmetic picks 128-aligned channel (or head, or expert) ranges per rank, and ``decide_cuts`` turns
both into one Cut per module per rank. No I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from exl3tools.checkpoint.reader import Checkpoint
from exl3tools.errors import IncompatibleSliceError
from exl3tools.exl3 import BLOCK
from exl3tools.layout import MLA_ARCHS, scan_refs

# module prefix pattern -> role. First match wins; no match = replicate (docs/rank-slice.md §3).
SLICE_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), r) for p, r in (
    (r"\.mlp\.experts\.\d+\.(gate_proj|up_proj)$", "expert_col"),
    (r"\.mlp\.experts\.\d+\.down_proj$", "expert_row"),
    (r"\.self_attn\.indexer\.", "replicate"),
    (r"\.self_attn\.(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj)$", "attn_col"),
    (r"\.self_attn\.o_proj$", "attn_row"),
    (r"\.mlp(\.shared_experts)?\.(gate_proj|up_proj)$", "mlp_col"),
    (r"\.mlp(\.shared_experts)?\.down_proj$", "mlp_row"),
    (r"^lm_head$", "vocab_col"),
))


def role_of(prefix: str) -> str:
    if ".mlp." not in prefix and ".self_attn." not in prefix and prefix != "lm_head":
        return "replicate"  # no rule can match: skip the 8 regexes (called ~6x per module)
    for pat, role in SLICE_RULES:
        if pat.search(prefix):
            return role
    return "replicate"


# ---------------------------------------------------------------------------- split arithmetic
def split_units(units: int, n: int) -> list[tuple[int, int]]:
    """Balanced contiguous [first, last) unit ranges, the first ``units % n`` ranks one larger."""
    base, rem = divmod(units, n)
    out, pos = [], 0
    for r in range(n):
        w = base + (1 if r < rem else 0)
        out.append((pos, pos + w))
        pos += w
    return out


def split128(size: int, n: int) -> list[tuple[int, int]] | None:
    """docs/rank-slice.md §3: 128-aligned balanced ranges, or None when some rank would get nothing."""
    if size % BLOCK or size // BLOCK < n:
        return None
    return [(a * BLOCK, b * BLOCK) for a, b in split_units(size // BLOCK, n)]


@dataclass(frozen=True, slots=True)
class AttnSplit:
    kind: str                                   # "gqa" | "mla"
    cut: str                                    # "heads" | "replicate"
    q: tuple[tuple[int, int], ...] = ()         # per rank q head range
    kv: tuple[tuple[int, int], ...] = ()        # per rank kv head range (GQA)
    nq: int = 0
    nkv: int = 0
    reason: str = ""


def gqa_split(cfg: dict, tp: int) -> AttnSplit:
    nq = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nq)
    hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nq)

    def rep(reason: str) -> AttnSplit:
        return AttnSplit("gqa", "replicate", nq=nq, nkv=nkv, reason=reason)

    if tp == 1:
        return AttnSplit("gqa", "heads", ((0, nq),), ((0, nkv),), nq, nkv)
    if nq % tp:
        return rep(f"{nq} q heads do not divide over {tp} ranks")
    qp = nq // tp
    if qp * hd % BLOCK:
        return rep(f"{qp} q heads x head_dim {hd} per rank is not a multiple of 128")
    if nkv >= tp:
        if nkv % tp:
            return rep(f"{nkv} kv heads do not divide over {tp} ranks")
        kp = nkv // tp
        if kp * hd % BLOCK:
            return rep(f"{kp} kv heads x head_dim {hd} per rank is not a multiple of 128")
        kv = tuple((r * kp, (r + 1) * kp) for r in range(tp))
    else:
        if tp % nkv:
            return rep(f"{nkv} kv heads cannot be replicated evenly over {tp} ranks")
        if hd % BLOCK:
            return rep(f"1 kv head x head_dim {hd} per rank is not a multiple of 128")
        g = tp // nkv
        kv = tuple((r // g, r // g + 1) for r in range(tp))
    q = tuple((r * qp, (r + 1) * qp) for r in range(tp))
    return AttnSplit("gqa", "heads", q, kv, nq, nkv)


def mla_split(cfg: dict, tp: int, kv_b_exl3: bool) -> AttnSplit:
    nh = int(cfg["num_attention_heads"])
    qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
    kvb = int(cfg["qk_nope_head_dim"]) + int(cfg["v_head_dim"])
    v = int(cfg["v_head_dim"])

    def rep(reason: str) -> AttnSplit:
        return AttnSplit("mla", "replicate", nq=nh, reason=reason)

    if tp == 1:
        return AttnSplit("mla", "heads", ((0, nh),), (), nh)
    if nh % tp:
        return rep(f"{nh} heads do not divide over {tp} ranks")
    h = nh // tp
    if h * qk % BLOCK:
        return rep(f"{h} heads x qk {qk} per rank is not a multiple of 128")
    if h * v % BLOCK:
        return rep(f"{h} heads x v_head_dim {v} per rank is not a multiple of 128")
    if kv_b_exl3 and h * kvb % BLOCK:
        return rep(f"{h} heads x {kvb} kv_b channels per rank is not a multiple of 128 (EXL3 kv_b_proj)")
    return AttnSplit("mla", "heads", tuple((r * h, (r + 1) * h) for r in range(tp)), (), nh)


def attn_channels(cfg: dict, split: AttnSplit, leaf: str, r: int) -> tuple[int, int]:
    """Channel range [first, last) of rank r for one attention projection."""
    q0, q1 = split.q[r]
    if split.kind == "gqa":
        hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // split.nq)
        if leaf in ("k_proj", "v_proj"):
            k0, k1 = split.kv[r]
            return k0 * hd, k1 * hd
        return q0 * hd, q1 * hd                 # q_proj, o_proj
    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    w = {"q_proj": nope + rope, "q_b_proj": nope + rope, "kv_b_proj": nope + v, "o_proj": v}[leaf]
    return q0 * w, q1 * w


def attn_expected(cfg: dict, split: AttnSplit, leaf: str) -> int:
    return attn_channels(cfg, AttnSplit(split.kind, "heads", ((0, split.nq),), ((0, split.nkv),),
                                        split.nq, split.nkv), leaf, 0)[1]


# ---------------------------------------------------------------------------- modules
@dataclass(frozen=True, slots=True)
class Module:
    prefix: str
    kind: str                      # "exl3" | "dense_linear" | "dense"
    tensors: tuple[str, ...]       # full tensor names
    n: int = 0                     # out channels (padded for EXL3)
    k: int = 0                     # in channels


def collect_modules(ck: Checkpoint) -> dict[str, Module]:
    L = int(ck.config.get("num_hidden_layers", 0) or 0)
    sc = scan_refs(ck.tensors, L)
    mods: dict[str, Module] = {}
    for p, lin in sc.linears.items():
        names = tuple(f"{p}.{s}" for s in lin.suffixes)
        mods[p] = Module(p, "exl3", names, lin.n, lin.k)
    for name, (_dtype, shape) in sc.dense.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and len(shape) == 2 and role_of(prefix) != "replicate" and prefix not in mods:
            names = (name,) + ((f"{prefix}.bias",) if f"{prefix}.bias" in sc.dense else ())
            mods[prefix] = Module(prefix, "dense_linear", names, shape[0], shape[1])
    owned = {t for m in mods.values() for t in m.tensors}
    grouped: dict[str, list[str]] = {}  # lists, then one tuple each: appending to a tuple is quadratic
    for name in sc.dense:
        if name in owned:
            continue
        prefix = name.rpartition(".")[0] or name
        kind = mods[prefix].kind if prefix in mods else "dense"
        if kind == "exl3":
            # a stray tensor under an EXL3 linear (P.weight beside P.trellis, P.foo): no loader reads
            # it (validate W302), so it is its own module, copied whole to every rank, not left unowned
            prefix = name
        elif kind == "dense_linear":  # e.g. an fp8 weight's scales: cut like the weight, or wrong
            raise IncompatibleSliceError(f"{name}: rank-slice cuts only .weight and .bias of the split "
                                         f"linear {prefix}, not this tensor")
        grouped.setdefault(prefix, []).append(name)
    for prefix, names in grouped.items():
        mods[prefix] = Module(prefix, "dense", tuple(names))
    return mods


def _layer_prefix(prefix: str) -> str:
    m = re.match(r"^(model\.layers\.\d+)\.", prefix)
    return m.group(1) if m else ""


# Cut of one module on one rank: ("replicate",) | ("column"|"row", first, last, size) | ("absent",)
Cut = tuple


def decide_cuts(ck: Checkpoint, mods: dict[str, Module], tp: int, moe: str
                ) -> tuple[list[dict[str, Cut]], list[dict[str, dict]], list[dict[str, dict]], list[str]]:
    """Per rank: module -> Cut; per rank: attention entries; per rank: expert-layer entries; notes."""
    cfg = ck.config
    arch = ck.architecture
    cuts: list[dict[str, Cut]] = [{} for _ in range(tp)]
    attn_entries: list[dict[str, dict]] = [{} for _ in range(tp)]
    expert_entries: list[dict[str, dict]] = [{} for _ in range(tp)]
    notes: list[str] = []

    def set_all(p: str, c: Cut) -> None:
        for r in range(tp):
            cuts[r][p] = c

    def set_split(p: str, how: str, ranges: list[tuple[int, int]], size: int) -> None:
        for r in range(tp):
            cuts[r][p] = (how, ranges[r][0], ranges[r][1], size)

    def size_of(m: Module, how: str) -> int:
        return m.n if how == "column" else m.k

    # ---- attention, per layer
    attn_layers = sorted({_layer_prefix(p) for p in mods if role_of(p) in ("attn_col", "attn_row")})
    for lp in attn_layers:
        ap = f"{lp}.self_attn"
        members = {p.rsplit(".", 1)[1]: mods[p] for p in mods
                   if p.startswith(ap + ".") and role_of(p) in ("attn_col", "attn_row")}
        if arch in MLA_ARCHS:
            kvb = members.get("kv_b_proj")
            split = mla_split(cfg, tp, kvb is not None and kvb.kind == "exl3")
        else:
            try:
                split = gqa_split(cfg, tp)
            except (KeyError, TypeError, ValueError):
                split = AttnSplit("gqa", "replicate", reason="config lacks head counts")
        if split.cut == "heads":
            for leaf, m in members.items():
                how = "row" if leaf == "o_proj" else "column"
                if size_of(m, how) != attn_expected(cfg, split, leaf):
                    split = AttnSplit(split.kind, "replicate", nq=split.nq, nkv=split.nkv,
                                      reason=f"{m.prefix}: {size_of(m, how)} stored channels, "
                                             f"expected {attn_expected(cfg, split, leaf)} for its heads")
                    break
        for r in range(tp):
            e: dict[str, Any] = {"kind": split.kind, "cut": split.cut, "num_q_heads": split.nq}
            if split.kind == "gqa":
                e["num_kv_heads"] = split.nkv
            if split.cut == "heads":
                e["q_heads"] = list(split.q[r])
                if split.kind == "gqa":
                    e["kv_heads"] = list(split.kv[r])
            else:
                e["reason"] = split.reason
            attn_entries[r][ap] = e
        if split.cut == "replicate" and tp > 1:
            notes.append(f"{ap}: replicated on every rank ({split.reason})")
        for leaf, m in members.items():
            if split.cut != "heads" or tp == 1:
                set_all(m.prefix, ("replicate",))
                continue
            how = "row" if leaf == "o_proj" else "column"
            set_split(m.prefix, how, [attn_channels(cfg, split, leaf, r) for r in range(tp)], size_of(m, how))

    # ---- dense MLP / shared experts groups
    groups = sorted({p.rsplit(".", 1)[0] for p in mods if role_of(p) in ("mlp_col", "mlp_row")})
    for g in groups:
        members = {leaf: mods.get(f"{g}.{leaf}") for leaf in ("gate_proj", "up_proj", "down_proj")}
        present = {k: v for k, v in members.items() if v is not None}
        sizes = {v.n if k != "down_proj" else v.k for k, v in present.items()}
        ranges = split128(next(iter(sizes)), tp) if len(sizes) == 1 else None
        if ranges is None or tp == 1:
            if tp > 1:
                notes.append(f"{g}: replicated on every rank (intermediate {sorted(sizes)} "
                             f"cannot be cut into {tp} x 128-multiples)")
            for v in present.values():
                set_all(v.prefix, ("replicate",))
            continue
        for leaf, v in present.items():
            how = "row" if leaf == "down_proj" else "column"
            set_split(v.prefix, how, ranges, size_of(v, how))

    # ---- routed experts, per layer
    elayers: dict[str, list[Module]] = {}
    for p, m in mods.items():
        if role_of(p) in ("expert_col", "expert_row"):
            elayers.setdefault(p.split(".mlp.experts.")[0] + ".mlp.experts", []).append(m)
    for ep_prefix, ms in sorted(elayers.items()):
        ids = sorted({int(m.prefix[len(ep_prefix) + 1:].split(".")[0]) for m in ms})
        count = len(ids)
        if moe == "ep":
            ranges = split_units(count, tp)
            owner = {}
            for r, (a, b) in enumerate(ranges):
                for i in ids[a:b]:
                    owner[i] = r
                first = ids[a] if a < b else (ids[-1] + 1 if ids else 0)
                last = ids[b - 1] + 1 if a < b else first
                expert_entries[r][ep_prefix] = {"cut": "experts", "first": first, "last": last, "count": count}
            if count % tp:
                notes.append(f"{ep_prefix}: {count} experts over {tp} ranks is uneven")
            for m in ms:
                e = int(m.prefix[len(ep_prefix) + 1:].split(".")[0])
                for r in range(tp):
                    cuts[r][m.prefix] = ("replicate",) if owner[e] == r else ("absent",)
            continue
        sizes = {m.n if role_of(m.prefix) == "expert_col" else m.k for m in ms}
        if len(sizes) != 1:
            raise IncompatibleSliceError(f"{ep_prefix}: experts have different intermediate widths "
                                         f"{sorted(sizes)}; use --moe ep")
        size = sizes.pop()
        if size % (BLOCK * tp):
            raise IncompatibleSliceError(
                f"{ep_prefix}: expert intermediate {size} is not a multiple of 128 x {tp} = {BLOCK * tp}, "
                f"so it cannot be split evenly over {tp} ranks at 128-channel boundaries; use --moe ep")
        w = size // tp
        for r in range(tp):
            expert_entries[r][ep_prefix] = {"cut": "tp", "first": r * w, "last": (r + 1) * w,
                                            "size": size, "count": count}
        for m in ms:
            how = "column" if role_of(m.prefix) == "expert_col" else "row"
            set_split(m.prefix, how, [(r * w, (r + 1) * w) for r in range(tp)], size_of(m, how))

    # ---- lm_head and everything else
    for p, m in mods.items():
        if p in cuts[0]:
            continue
        if role_of(p) == "vocab_col" and m.kind != "dense":
            ranges = split128(m.n, tp)
            if ranges is None or tp == 1:
                if tp > 1:
                    notes.append(f"{p}: replicated ({m.n} channels cannot be cut into {tp} x 128-multiples)")
                set_all(p, ("replicate",))
            else:
                set_split(p, "column", ranges, m.n)
            continue
        set_all(p, ("replicate",))
    return cuts, attn_entries, expert_entries, notes


def tensor_slice(m: Module, name: str, cut: Cut, shape: tuple[int, ...]
                 ) -> tuple[int | None, int | None, int | None] | None:
    """(dim, start, stop) of ``name`` for this cut; (None, None, None) = whole; None = absent."""
    whole = (None, None, None)
    kind = cut[0]
    if kind == "absent":
        return None
    if kind == "replicate":
        return whole
    _, f, e, size = cut
    suffix = name.rsplit(".", 1)[1]
    if f == 0 and e == size:
        return whole
    if suffix in ("mcg", "mul1", "scale"):
        return whole
    if m.kind == "exl3":
        if kind == "column":
            sl = {"trellis": (1, f // 16, e // 16), "svh": (0, f, e), "sv": (0, f // 16, e // 16),
                  "bias": (0, f, e)}
        else:
            sl = {"trellis": (0, f // 16, e // 16), "suh": (0, f, e), "su": (0, f // 16, e // 16)}
            if suffix == "bias":
                return whole if f == 0 else None
        return sl.get(suffix, whole)
    # unquantized linear, HF (out, in)
    if suffix == "bias":
        return (0, f, e) if kind == "column" else (whole if f == 0 else None)
    return (0, f, e) if kind == "column" else (1, f, e)


def cut_json(c: Cut, m: Module, rank_has_bias: bool) -> dict[str, Any]:
    if c[0] in ("replicate", "absent"):
        return {"cut": c[0]}
    out = {"cut": c[0], "first": c[1], "last": c[2], "size": c[3]}
    if c[0] == "row":
        out["bias"] = rank_has_bias
    return out
