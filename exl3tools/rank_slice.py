"""Cut an EXL3 checkpoint into per-rank shards at 128-channel boundaries (docs/rank-slice.md).

``plan_rank_slices`` is pure (headers + config in, a RankPlan value out, no I/O beyond what
Checkpoint.open already read); ``write_rank_shards`` streams bytes from the source to the ranks:
each source shard is read once, sequentially, in bounded chunks, and every rank file is written
sequentially while it is hashed, so nothing is read back and peak memory stays at a few chunks.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import signal
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exl3tools import __version__
from exl3tools.checkpoint.header import DTYPES
from exl3tools.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    RankEntry,
    RankManifest,
    SourceFile,
    SourceInfo,
    load_manifest,
    sha256_file,
)
from exl3tools.checkpoint.reader import INDEX_NAME, TOKENIZER_FILES, Checkpoint, pread_fd
from exl3tools.checkpoint.writer import (
    AsyncShardWriter,
    ByteBudget,
    FileRange,
    NullWriter,
    fsync_dir,
    index_json,
    json_bytes,
    write_atomic,
    write_atomic_text,
)
from exl3tools.errors import IncompatibleSliceError, OutputExistsError, UsageError
from exl3tools.exl3 import BLOCK
from exl3tools.layout import MLA_ARCHS, real_dims, scan

FORMAT = "exl3tools.rank-slice"
FORMAT_VERSION = 1
JOURNAL = ".rank-slice.journal"
CHUNK_BYTES = 32 << 20          # bound on one read; peak RSS ~ a few of these + the write budget
PREFETCH_BYTES = 128 << 20      # read-ahead window per source shard (page cache, not RSS)
KILL_ENV = "EXL3TOOLS_TEST_KILL_AFTER_FILES"  # crash tests: SIGKILL self after N finished files

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
    for pat, role in SLICE_RULES:
        if pat.search(prefix):
            return role
    return "replicate"


# ---------------------------------------------------------------------------- plan values
@dataclass(frozen=True, slots=True)
class OutTensor:
    name: str                    # name in the output file
    src: str                     # source tensor name (or linear prefix for "dequantize")
    dtype: str
    shape: tuple[int, ...]
    dim: int | str | None        # None = whole copy; int = slice along dim; "dequantize"
    start: int | None = None
    stop: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][0]

    def spec(self) -> list:
        return [None if self.src == self.name else self.src, self.dim, self.start, self.stop]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    source_file: str
    out_name: str
    outputs: tuple[tuple[OutTensor, ...], ...]   # per output dir (rank), in file order


@dataclass(frozen=True, slots=True)
class RankPlan:
    tp: int
    moe: str
    layout: str
    source: SourceInfo
    dirs: tuple[str, ...]                         # output dir per rank ("." for vllm-hybrid)
    shards: tuple[ShardPlan, ...]
    configs: tuple[dict[str, Any], ...]           # the config.json written in each dir
    notes: tuple[str, ...]                        # decisions worth telling the user
    fingerprint: str
    cuts: tuple[dict[str, Any], ...] = field(default=())  # per rank: module -> cut (for --dry-run)

    def summary(self) -> dict[str, Any]:
        per_dir = []
        for i, d in enumerate(self.dirs):
            outs = [t for s in self.shards for t in s.outputs[i]]
            per_dir.append({"dir": d, "tensors": len(outs), "bytes": sum(t.nbytes for t in outs)})
        return {"tp": self.tp, "moe": self.moe, "layout": self.layout, "source": self.source.path,
                "source_fingerprint": self.source.fingerprint, "plan_fingerprint": self.fingerprint,
                "outputs": per_dir, "notes": list(self.notes)}

    def to_json(self) -> dict[str, Any]:
        out = self.summary()
        if self.cuts:
            out["cuts"] = list(self.cuts)
        return out


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
    sc = scan({n: (t.dtype, t.shape) for n, t in ck.tensors.items()}, L)
    mods: dict[str, Module] = {}
    for p, lin in sc.linears.items():
        names = tuple(f"{p}.{s}" for s in lin.suffixes)
        mods[p] = Module(p, "exl3", names, lin.n, lin.k)
    for name, (_dtype, shape) in sc.dense.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and len(shape) == 2 and role_of(prefix) != "replicate":
            names = (name,) + ((f"{prefix}.bias",) if f"{prefix}.bias" in sc.dense else ())
            mods[prefix] = Module(prefix, "dense_linear", names, shape[0], shape[1])
    for name in sc.dense:
        prefix = name.rpartition(".")[0] or name
        if prefix in mods and name in mods[prefix].tensors:
            continue
        m = mods.get(prefix)
        if m is None:
            mods[prefix] = Module(prefix, "dense", (name,))
        elif m.kind == "dense":
            mods[prefix] = Module(prefix, "dense", m.tensors + (name,))
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


# ---------------------------------------------------------------------------- fingerprints
def source_info(ck: Checkpoint) -> SourceInfo:
    cfg_bytes = (ck.root / "config.json").read_bytes()
    h = hashlib.sha256(cfg_bytes)
    files = []
    for fname in sorted(ck.headers):
        hd = ck.headers[fname]
        with open(ck.root / fname, "rb", buffering=0) as f:
            hbytes = os.pread(f.fileno(), hd.data_start, 0)
        hs = hashlib.sha256(hbytes).hexdigest()
        files.append(SourceFile(fname, hd.file_size, hs))
        h.update(f"\0{fname}\0{hd.file_size}\0{hs}".encode())
    return SourceInfo(str(ck.root.resolve()), "sha256:" + h.hexdigest(), ck.architecture,
                      hashlib.sha256(cfg_bytes).hexdigest(), tuple(files))


def _plan_fingerprint(source: SourceInfo, tp: int, moe: str, layout: str, dirs: tuple[str, ...],
                      shards: list[ShardPlan], configs: list[dict]) -> str:
    h = hashlib.sha256(json.dumps([source.fingerprint, tp, moe, layout, dirs]).encode())
    for s in shards:
        h.update(json.dumps([s.source_file, s.out_name]).encode())
        for outs in s.outputs:
            h.update(json.dumps([[t.name, t.dtype, list(t.shape)] + t.spec() for t in outs]).encode())
    h.update(json.dumps(configs, sort_keys=True).encode())
    return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------------------- planning
def plan_rank_slices(ck: Checkpoint, tp: int, moe: str = "tp", layout: str = "ranks") -> RankPlan:
    """The complete slicing plan (a value; nothing is written)."""
    if tp < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    if moe not in ("tp", "ep"):
        raise UsageError(f"--moe must be tp or ep, got {moe!r}")
    if layout == "vllm-hybrid":
        return plan_hybrid(ck, tp, moe)
    if layout != "ranks":
        raise UsageError(f"--layout must be ranks or vllm-hybrid, got {layout!r}")
    if not ck.is_exl3:
        from exl3tools.errors import NotExl3Error

        raise NotExl3Error(f"{ck.root}: quantization_config.quant_method is not exl3")
    mods = collect_modules(ck)
    cuts, attn, experts, notes = decide_cuts(ck, mods, tp, moe)
    owner = {t: m for m in mods.values() for t in m.tensors}
    missing = [n for n in ck.tensors if n not in owner]
    if missing:  # collect_modules must cover every tensor; a gap here is a bug, not bad input
        raise RuntimeError(f"tensors without a module: {missing[:5]}")
    source = source_info(ck)
    dirs = tuple(f"rank-{r}-of-{tp}" for r in range(tp))

    files = sorted(ck.headers)
    nfiles = len(files)
    shards: list[ShardPlan] = []
    for i, fname in enumerate(files):
        hd = ck.headers[fname]
        order = sorted(hd.tensors.values(), key=lambda t: t.begin)
        per_rank: list[tuple[OutTensor, ...]] = []
        shared: dict[tuple, OutTensor] = {}   # identical entries of several ranks: one object (memory)
        for r in range(tp):
            outs = []
            for info in order:
                m = owner[info.name]
                sl = tensor_slice(m, info.name, cuts[r][m.prefix], info.shape)
                if sl is None:
                    continue
                key = (info.name,) + sl
                t = shared.get(key)
                if t is None:
                    dim, a, b = sl
                    shape = info.shape if dim is None else tuple(b - a if d == dim else s
                                                                 for d, s in enumerate(info.shape))
                    t = shared[key] = OutTensor(info.name, info.name, info.dtype, shape, dim, a, b)
                outs.append(t)
            per_rank.append(tuple(outs))
        shards.append(ShardPlan(fname, f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors", tuple(per_rank)))

    configs = []
    cut_tables = []
    for r in range(tp):
        modules: dict[str, Any] = {}
        for p, m in sorted(mods.items()):
            if role_of(p) in ("expert_col", "expert_row"):
                continue
            has_bias = any(t.endswith(".bias") for t in m.tensors)
            c = cuts[r][p]
            modules[p] = cut_json(c, m, has_bias and c[0] == "row" and c[1] == 0)
        modules.update(experts[r])
        block = {"format": FORMAT, "format_version": FORMAT_VERSION, "layout": "ranks", "tp": tp, "rank": r,
                 "moe": moe, "source_fingerprint": source.fingerprint,
                 "attention": attn[r], "modules": dict(sorted(modules.items()))}
        cfg = dict(ck.config)
        cfg["exl3tools"] = block
        configs.append(cfg)
        cut_tables.append({"rank": r, "attention": attn[r], "modules": block["modules"]})
    fp = _plan_fingerprint(source, tp, moe, "ranks", dirs, shards, configs)
    return RankPlan(tp, moe, "ranks", source, dirs, tuple(shards), tuple(configs), tuple(notes), fp,
                    tuple(cut_tables))


# ---------------------------------------------------------------------------- writing
class _Journal:
    """Append-only record of finished files; --resume trusts an entry only if the hash still matches."""

    def __init__(self, dst: Path, plan_fp: str):
        self.path = dst / JOURNAL
        self.plan_fp = plan_fp
        self.lock = threading.Lock()
        self.done: dict[str, FileEntry] = {}
        self.count = 0
        kill = os.environ.get(KILL_ENV)
        self.kill_after = int(kill) if kill else None

    def load(self, expected: set[str], previous: dict[str, FileEntry] | None = None) -> None:
        """Trust journal lines (and a previous complete manifest of the same plan) whose file still
        has the recorded size and sha256."""
        entries = [{"path": k, "size": v.size, "sha256": v.sha256, "plan": self.plan_fp}
                   for k, v in (previous or {}).items()]
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn last line from a crash
        for e in entries:
            if e.get("plan") != self.plan_fp or e.get("path") not in expected or e["path"] in self.done:
                continue
            p = self.path.parent / e["path"]
            if p.is_file() and p.stat().st_size == e["size"] and sha256_file(p) == e["sha256"]:
                self.done[e["path"]] = FileEntry(e["size"], e["sha256"])

    def record(self, rel: str, size: int, sha: str) -> None:
        with self.lock:
            self.done[rel] = FileEntry(size, sha)
            line = json.dumps({"path": rel, "size": size, "sha256": sha, "plan": self.plan_fp}) + "\n"
            with open(self.path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self.count += 1
            if self.kill_after is not None and self.count >= self.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)


def _stream_copy(fd: int, begin: int, shape: tuple[int, ...], itemsize: int,
                 targets: list[tuple[Any, OutTensor]], progress: Callable[[int], None]) -> None:
    """Read one source tensor once, in chunks of whole dim-0 rows, and feed every target its part."""
    if not shape or math.prod(shape) == 0:
        data = pread_fd(fd, begin, math.prod(shape) * itemsize) if shape == () else b""
        for w, _t in targets:
            w.write(data)
            progress(len(data))
        return
    row = math.prod(shape[1:]) * itemsize
    rows_per = max(1, CHUNK_BYTES // max(row, 1))
    for a in range(0, shape[0], rows_per):
        b = min(shape[0], a + rows_per)
        need = [(w, t) for w, t in targets
                if not (t.dim == 0 and (t.stop <= a or t.start >= b))]
        if not need:
            continue
        buf = pread_fd(fd, begin + a * row, (b - a) * row)
        arr = None
        for w, t in need:
            if t.dim is None:
                piece = memoryview(buf)
            elif t.dim == 0:
                s, e = max(t.start, a) - a, min(t.stop, b) - a
                piece = memoryview(buf)[s * row:e * row]
            else:
                if arr is None:
                    arr = np.frombuffer(buf, dtype=np.uint8).reshape((b - a,) + shape[1:] + (itemsize,))
                idx = [slice(None)] * arr.ndim
                idx[t.dim] = slice(t.start, t.stop)
                piece = memoryview(np.ascontiguousarray(arr[tuple(idx)]).reshape(-1))
            w.write(piece)
            progress(piece.nbytes)


SMALL_COPY = 1 << 20             # pieces below this go through a plain bytes copy


def _map_copy(mm: mmap.mmap, fd: int, begin: int, shape: tuple[int, ...], itemsize: int,
              targets: list[tuple[Any, OutTensor]], progress: Callable[[int], None]) -> None:
    """Feed every target its part of one source tensor. Contiguous parts (whole tensors, dim-0
    slices) travel as FileRange: the writer hashes them through the map and copies them in-kernel
    (copy_file_range); strided parts are gathered from the map in chunks of dim-0 rows."""
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return
    row = nbytes // shape[0] if shape else nbytes

    def send(w: Any, off: int, n: int) -> None:
        for o in range(off, off + n, CHUNK_BYTES):
            m = min(CHUNK_BYTES, off + n - o)
            # small pieces by pread: touching the map would also map (fault-around) neighbours
            w.write(pread_fd(fd, o, m) if m < SMALL_COPY else FileRange(mm, fd, o, m))
            progress(m)

    strided = []
    for w, t in targets:
        if t.dim is None:
            send(w, begin, nbytes)
        elif t.dim == 0:
            send(w, begin + t.start * row, (t.stop - t.start) * row)
        else:
            strided.append((w, t))
    if not strided:
        return
    arr = np.frombuffer(mm, np.uint8, count=nbytes, offset=begin).reshape(shape + (itemsize,))
    try:
        step = max(1, CHUNK_BYTES // row)
        for r0 in range(0, shape[0], step):
            r1 = min(shape[0], r0 + step)
            for w, t in strided:
                idx: list[slice] = [slice(None)] * arr.ndim
                idx[0] = slice(r0, r1)
                idx[t.dim] = slice(t.start, t.stop)
                piece = memoryview(np.ascontiguousarray(arr[tuple(idx)]).reshape(-1))
                w.write(piece)
                progress(piece.nbytes)
            lo = begin + r0 * row
            lo -= lo % mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, lo, begin + r1 * row - lo)  # keep RSS bounded
    finally:
        del arr


def _write_one_shard(ck: Checkpoint, plan: RankPlan, si: int, dst: Path, journal: _Journal,
                     progress: Callable[[int], None], dequant: Callable | None, budget: ByteBudget) -> None:
    sp = plan.shards[si]
    rels = [f"{d}/{sp.out_name}" if d != "." else sp.out_name for d in plan.dirs]
    if all(r in journal.done for r in rels):
        progress(sum(t.nbytes for outs in sp.outputs for t in outs))
        return
    hd = ck.headers[sp.source_file]
    by_src: dict[str, list[tuple[int, OutTensor]]] = {}   # source tensor -> its targets
    for i, outs in enumerate(sp.outputs):
        for t in outs:
            by_src.setdefault(t.src, []).append((i, t))
    fd = os.open(ck.root / sp.source_file, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    writers: list[Any] = []
    ahead = 0  # the kernel reads [.., ahead) in the background while we slice and hash
    try:
        try:
            for i, outs in enumerate(sp.outputs):
                writers.append(NullWriter() if rels[i] in journal.done else
                               AsyncShardWriter(dst / rels[i], [(t.name, t.dtype, t.shape) for t in outs], budget))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            # walk the outputs in each writer's order: one pass over the source when every writer
            # takes at most one piece per source tensor (layout "ranks"), else piece by piece
            cursors = [0] * len(writers)
            while True:
                nxt = [(i, sp.outputs[i][cursors[i]]) for i in range(len(writers))
                       if cursors[i] < len(sp.outputs[i])]
                if not nxt:
                    break
                i0, t0 = min(nxt, key=lambda it: (_order_key(hd, it[1]), it[0]))
                if t0.dim == "dequantize":
                    dequant(ck, t0, writers[i0], progress)
                    cursors[i0] += 1
                    continue
                info = hd.tensors[t0.src]
                if ahead < info.end + PREFETCH_BYTES // 2:
                    start = max(ahead, info.begin)
                    ahead = info.end + PREFETCH_BYTES
                    os.posix_fadvise(fd, start, ahead - start, os.POSIX_FADV_WILLNEED)
                group = [(i, t) for i, t in by_src[t0.src] if cursors[i] < len(sp.outputs[i])
                         and sp.outputs[i][cursors[i]] is t]
                _map_copy(mm, fd, info.begin, info.shape, info.itemsize,
                          [(writers[i], t) for i, t in group], progress)
                for i, _ in group:
                    cursors[i] += 1
            done = [(rels[i], w.close()) for i, w in enumerate(writers) if not isinstance(w, NullWriter)]
        except BaseException:
            for w in writers:
                w.abort()
            raise
    finally:
        try:
            mm.close()
        except BufferError:  # a view still alive after an error: the process is failing anyway
            pass
        os.close(fd)
    for rel, (size, sha) in done:
        journal.record(rel, size, sha)


def _order_key(hd: Any, t: OutTensor) -> int:
    info = hd.tensors.get(t.src)
    return info.begin if info is not None else -1


class _PlanTensors(Mapping):
    """name -> manifest spec of one output dir, read straight from the plan (no copy)."""

    def __init__(self, plan: RankPlan, i: int):
        self.plan, self.i = plan, i

    def _outs(self):
        return (t for s in self.plan.shards for t in s.outputs[self.i])

    def __iter__(self):
        return (t.name for t in self._outs())

    def __len__(self) -> int:
        return sum(len(s.outputs[self.i]) for s in self.plan.shards)

    def __getitem__(self, name: str) -> tuple:
        for t in self._outs():
            if t.name == name:
                return tuple(t.spec())
        raise KeyError(name)

    def items(self):  # type: ignore[override]
        return ((t.name, tuple(t.spec())) for t in self._outs())


def check_destination(dst: Path, resume: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise OutputExistsError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not resume:
        what = "a complete sliced output" if (dst / MANIFEST_NAME).exists() else "a non-empty directory"
        raise OutputExistsError(f"{dst}: {what} is already there (use --resume, or another DST)")


def write_rank_shards(ck: Checkpoint, plan: RankPlan, dst: str | os.PathLike[str], *, resume: bool = False,
                      threads: int | None = None, progress: Callable[[int], None] | None = None,
                      dequant: Callable | None = None) -> RankManifest:
    """Write every output of ``plan`` under ``dst``; manifest.json last. Returns the manifest."""
    dst = Path(dst)
    check_destination(dst, resume)
    dst.mkdir(parents=True, exist_ok=True)
    previous = None
    if resume and (dst / MANIFEST_NAME).is_file():
        try:
            old = load_manifest(dst)
            previous = old.files if old.plan_fingerprint == plan.fingerprint else None
        except Exception:  # a broken manifest is simply not trusted
            previous = None
    (dst / MANIFEST_NAME).unlink(missing_ok=True)  # a resumed run is incomplete until it ends
    for d in plan.dirs:
        (dst / d).mkdir(parents=True, exist_ok=True)
    journal = _Journal(dst, plan.fingerprint)
    if resume:
        small = (INDEX_NAME, "config.json", "quantization_config.json") + TOKENIZER_FILES
        expected = {f"{d}/{n}" if d != "." else n for d in plan.dirs
                    for n in [s.out_name for s in plan.shards] + list(small)}
        journal.load(expected, previous)
    lock = threading.Lock()

    def prog(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    # one reader per source shard (each byte read once); every output file hashes and writes on
    # its own thread (AsyncShardWriter), so a single shard already keeps several cores busy
    nthreads = threads or min(4, len(plan.shards))
    budget = ByteBudget()
    if nthreads == 1:
        for si in range(len(plan.shards)):
            _write_one_shard(ck, plan, si, dst, journal, prog, dequant, budget)
    else:
        with ThreadPoolExecutor(nthreads) as pool:
            futs = [pool.submit(_write_one_shard, ck, plan, si, dst, journal, prog, dequant, budget)
                    for si in range(len(plan.shards))]
            try:
                for f in futs:
                    f.result()
            except BaseException:
                for f in futs:
                    f.cancel()
                raise

    # small files per output dir: index, config, quantization_config, tokenizer files
    ranks = []
    for i, d in enumerate(plan.dirs):
        base = dst / d
        wm = {t.name: s.out_name for s in plan.shards for t in s.outputs[i]}
        total = sum(t.nbytes for s in plan.shards for t in s.outputs[i])
        small: dict[str, bytes] = {INDEX_NAME: index_json(wm, total), "config.json": json_bytes(plan.configs[i])}
        if ck.quantization_config_file is not None and plan.layout == "ranks":
            small["quantization_config.json"] = json_bytes(
                {k: v for k, v in ck.quantization_config_file.items() if k != "tensor_storage"})
        for tf in TOKENIZER_FILES:
            if (ck.root / tf).is_file():
                small[tf] = (ck.root / tf).read_bytes()
        for name, data in small.items():
            r = f"{d}/{name}" if d != "." else name
            if r in journal.done and journal.done[r].sha256 == hashlib.sha256(data).hexdigest():
                continue
            size, sha = write_atomic(base / name, data)
            journal.record(r, size, sha)
        fsync_dir(base)
        rank = plan.configs[i].get("exl3tools", {}).get("rank") if plan.layout == "ranks" else None
        ranks.append(RankEntry(rank, d, total, _PlanTensors(plan, i)))
    manifest = RankManifest(__version__, plan.layout, plan.tp, plan.moe, plan.source, plan.fingerprint,
                            tuple(ranks), dict(journal.done))
    write_atomic_text(dst / MANIFEST_NAME, manifest.dump)
    fsync_dir(dst)
    (dst / JOURNAL).unlink(missing_ok=True)
    return manifest


def real_dims_of(ck: Checkpoint) -> dict[str, tuple[int, int]]:
    return real_dims(ck.config, ck.tensors)


# ---------------------------------------------------------------------------- layout vllm-hybrid
HYBRID_SCHEMA = "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
_EXPERT_T = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.(\w+)$")


def plan_hybrid(ck: Checkpoint, tp: int, moe: str) -> RankPlan:
    """docs/rank-slice.md §6: one directory for the local-inference-lab vLLM EXL3 backend.

    Routed experts become ``….{proj}.rank{r}.{field}`` (tp cut); every other EXL3 linear is
    dequantized to a full-size BF16 ``.weight`` (that backend runs non-expert linears unquantized).
    Everything the backend would reject is refused here, before anything is written.
    """
    def refuse(msg: str) -> IncompatibleSliceError:
        return IncompatibleSliceError(f"--layout vllm-hybrid: {msg}")

    if moe != "tp":
        raise refuse("the vLLM EXL3 backend has no expert parallelism (use --moe tp)")
    if not ck.is_exl3:
        raise refuse(f"{ck.root} is not an EXL3 checkpoint")
    mods = collect_modules(ck)
    cuts, _attn, experts, _notes = decide_cuts(ck, mods, tp, "tp")  # raises on I % (128*tp)
    experts_lin = [m for p, m in mods.items() if role_of(p) in ("expert_col", "expert_row")]
    if not experts_lin:
        raise refuse("no routed experts: nothing for that backend to load as rank-sliced EXL3")
    widths = set()
    for m in experts_lin:
        if m.kind != "exl3":
            raise refuse(f"{m.prefix} is not EXL3")
        if f"{m.prefix}.mcg" not in ck:
            raise refuse(f"{m.prefix}: the backend requires the mcg codebook (convert with -cb mcg)")
        if f"{m.prefix}.bias" in ck:
            raise refuse(f"{m.prefix}: expert biases are not supported by the backend")
        if f"{m.prefix}.suh" not in ck or f"{m.prefix}.svh" not in ck:
            raise refuse(f"{m.prefix}: legacy su/sv; run exl3tools normalize first")
        widths.add(ck.ref(f"{m.prefix}.trellis").shape[2])
    if len(widths) != 1 or (next(iter(widths)) // 16) not in (3, 4, 5, 6) or next(iter(widths)) % 16:
        raise refuse(f"expert bitrates {sorted(w / 16 for w in widths)}: the backend needs one integral K in 3..6")
    bits = next(iter(widths)) // 16
    rd = real_dims(ck.config, ck.tensors)
    owner = {t: m for m in mods.values() for t in m.tensors}
    source = source_info(ck)
    moe_layers = sorted({int(_EXPERT_T.match(f"{m.prefix}.trellis").group(1)) for m in experts_lin})
    files = sorted(ck.headers)
    shards = []
    for i, fname in enumerate(files):
        outs: list[OutTensor] = []
        for info in sorted(ck.headers[fname].tensors.values(), key=lambda t: t.begin):
            m = owner[info.name]
            leaf = info.name.rsplit(".", 1)[1]
            if role_of(m.prefix) in ("expert_col", "expert_row"):
                if leaf not in ("trellis", "suh", "svh", "mcg"):
                    raise refuse(f"{info.name}: field {leaf!r} is not in the backend's tensor schema")
                for r in range(tp):
                    sl = tensor_slice(m, info.name, cuts[r][m.prefix], info.shape)
                    dim, a, b = sl
                    shape = info.shape if dim is None else tuple(b - a if d == dim else x
                                                                 for d, x in enumerate(info.shape))
                    outs.append(OutTensor(f"{m.prefix}.rank{r}.{leaf}", info.name, info.dtype, shape, dim, a, b))
            elif m.kind == "exl3":
                in_r, out_r = rd.get(m.prefix, (m.k, m.n))
                if leaf == "trellis":
                    outs.append(OutTensor(f"{m.prefix}.weight", m.prefix, "BF16", (out_r, in_r), "dequantize"))
                elif leaf == "bias":
                    outs.append(OutTensor(info.name, info.name, info.dtype, (out_r,),
                                          None if out_r == info.shape[0] else 0, *((None, None) if out_r == info.shape[0]
                                                                                   else (0, out_r))))
            else:
                outs.append(OutTensor(info.name, info.name, info.dtype, info.shape, None))
        shards.append(ShardPlan(fname, f"model-{i + 1:05d}-of-{len(files):05d}.safetensors", (tuple(outs),)))
    cfg = dict(ck.config)
    cfg["hybrid_tr3_tail"] = {
        "format": "exl3-trellis", "bits": float(bits), "codebook": "mcg",
        "experts_per_layer": len({m.prefix.split(".mlp.experts.")[1].split(".")[0] for m in experts_lin
                                  if m.prefix.startswith(f"model.layers.{moe_layers[0]}.")}),
        "moe_layers": [moe_layers[0], moe_layers[-1]], "tensor_schema": HYBRID_SCHEMA, "tp": tp,
        "exllamav3_version": str((ck.quantization_config or {}).get("version", "rank-sliced")),
        "producer": f"exl3tools {__version__}", "source_fingerprint": source.fingerprint,
    }
    notes = [f"{len([m for m in mods.values() if m.kind == 'exl3' and m not in experts_lin])} non-expert EXL3 "
             "linears are dequantized to BF16 .weight (the backend runs them unquantized)"]
    fp = _plan_fingerprint(source, tp, "tp", "vllm-hybrid", (".",), shards, [cfg])
    return RankPlan(tp, "tp", "vllm-hybrid", source, (".",), tuple(shards), (cfg,), tuple(notes), fp,
                    ({"rank": None, "attention": {}, "modules": {k: v for k, v in experts[0].items()}},))


def _bf16(x: np.ndarray) -> bytes:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2").tobytes()


def dequantize_to_writer(ck: Checkpoint, t: OutTensor, w: Any, progress: Callable[[int], None]) -> None:
    """Write ``t`` = BF16 HF (out_real, in_real) weight of the EXL3 linear ``t.src``, in column bands."""
    from exl3tools.exl3 import unpack_signs
    from exl3tools.kernels.reference import decode_rotated, rotate_out

    p = t.src
    out_r, in_r = t.shape
    kt, nt, _ = ck.ref(f"{p}.trellis").shape
    k = kt * 16
    suh = ck.read_numpy(f"{p}.suh") if f"{p}.suh" in ck else unpack_signs(ck.read_numpy(f"{p}.su"))
    svh = ck.read_numpy(f"{p}.svh") if f"{p}.svh" in ck else unpack_signs(ck.read_numpy(f"{p}.sv"))
    cb = "mcg" if f"{p}.mcg" in ck else "mul1" if f"{p}.mul1" in ck else "3inst"
    band = max(BLOCK, (CHUNK_BYTES // 8 // (k * 4)) // BLOCK * BLOCK)
    for c0 in range(0, out_r, band):
        c1 = min(nt * 16, c0 + band)
        c1 = -(-c1 // BLOCK) * BLOCK
        tr = ck.read_numpy_slice(f"{p}.trellis", 1, c0 // 16, c1 // 16)
        wband = rotate_out(decode_rotated(tr, cb), suh, svh[c0:c1])      # (k, c1-c0)
        rows = wband[:in_r, : min(c1, out_r) - c0].T                      # HF (out, in)
        data = _bf16(rows)
        w.write(data)
        progress(len(data))
