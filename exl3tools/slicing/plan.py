"""The rank-slice plan: a value saying which bytes of which source tensor go to which output file.

``plan_ranks`` takes headers + config and returns a RankPlan; nothing is written. The only
reads beyond what Checkpoint.open already did are the header bytes hashed into the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from exl3tools.checkpoint import jsonio
from exl3tools.checkpoint.header import DTYPES
from exl3tools.checkpoint.manifest import SourceFile, SourceInfo
from exl3tools.checkpoint.reader import Checkpoint
from exl3tools.errors import NotExl3Error
from exl3tools.slicing.cuts import collect_modules, cut_json, decide_cuts, role_of, tensor_slice

FORMAT = "exl3tools.rank-slice"
FORMAT_VERSION = 1


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


# ---------------------------------------------------------------------------- fingerprints
def source_info(ck: Checkpoint) -> SourceInfo:
    cfg_bytes = jsonio.read_regular(ck.root / "config.json", "config.json", jsonio.MAX_JSON_BYTES)
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
def _rank_tensors(ck: Checkpoint, tp: int, moe: str):
    """(modules, cuts, attention entries, expert entries, notes, per-file outputs per rank): what
    each rank holds, from headers and config only (no file is read)."""
    if not ck.is_exl3:
        raise NotExl3Error(f"{ck.root}: quantization_config.quant_method is not exl3")
    mods = collect_modules(ck)
    cuts, attn, experts, notes = decide_cuts(ck, mods, tp, moe)
    owner = {t: m for m in mods.values() for t in m.tensors}
    missing = [n for n in ck.tensors if n not in owner]
    if missing:  # collect_modules must cover every tensor; a gap here is a bug, not bad input
        raise RuntimeError(f"tensors without a module: {missing[:5]}")
    per_file: list[tuple[str, tuple[tuple[OutTensor, ...], ...]]] = []
    # a slice depends only on (module kind, cut, tensor suffix): a 700 GB checkpoint has ~240k
    # tensors x tp ranks, but a few hundred distinct keys
    memo: dict[tuple, tuple | None] = {}
    for fname in sorted(ck.headers):
        hd = ck.headers[fname]
        per_rank: list[list[OutTensor]] = [[] for _ in range(tp)]
        for info in sorted(hd.tensors.values(), key=lambda t: t.begin):
            m = owner[info.name]
            suffix = info.name.rpartition(".")[2]
            made: dict[tuple, OutTensor] = {}   # identical entries of several ranks: one object (memory)
            for r in range(tp):
                cut = cuts[r][m.prefix]
                key = (m.kind, cut, suffix)
                if key in memo:
                    sl = memo[key]
                else:
                    sl = memo[key] = tensor_slice(m, info.name, cut, info.shape)
                if sl is None:
                    continue
                t = made.get(sl)
                if t is None:
                    dim, a, b = sl
                    shape = info.shape if dim is None else tuple(b - a if d == dim else n
                                                                 for d, n in enumerate(info.shape))
                    t = made[sl] = OutTensor(info.name, info.name, info.dtype, shape, dim, a, b)
                per_rank[r].append(t)
        per_file.append((fname, tuple(tuple(outs) for outs in per_rank)))
    return mods, cuts, attn, experts, notes, per_file


def rank_holdings(ck: Checkpoint, tp: int, moe: str) -> tuple[list[list[OutTensor]], list[dict[str, dict]]]:
    """Per rank: the tensors it holds (as the runtime reads them, cut or whole) and its attention
    entries (heads per layer). Headers only: usable on a hub checkpoint read through its headers."""
    _, _, attn, _, _, per_file = _rank_tensors(ck, tp, moe)
    return [[t for _, outs in per_file for t in outs[r]] for r in range(tp)], attn


def plan_ranks(ck: Checkpoint, tp: int, moe: str) -> RankPlan:
    """The plan of layout "ranks": one directory per rank (a value; nothing is written)."""
    mods, cuts, attn, experts, notes, per_file = _rank_tensors(ck, tp, moe)
    source = source_info(ck)
    dirs = tuple(f"rank-{r}-of-{tp}" for r in range(tp))
    nfiles = len(per_file)
    shards = [ShardPlan(fname, f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors", outs)
              for i, (fname, outs) in enumerate(per_file)]

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
