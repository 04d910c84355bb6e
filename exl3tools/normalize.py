"""normalize SRC DST: one canonical naming and layout, so every later step needs one rule set.

What changes (docs/normalize.md), everything else is copied byte for byte:
- projection names: ``w1``/``w3``/``w2`` -> ``gate_proj``/``up_proj``/``down_proj`` (MLPs and experts);
- a fused ``gate_up_proj`` EXL3 linear is split exactly at its 128-aligned middle (gate first);
- MTP/nextn tails under ``mtp.``, ``model.mtp.``, ``model.nextn.`` move to ``model.layers.{L + i}.``;
- legacy packed ``su``/``sv`` become ``suh``/``svh`` (exact: exl3.unpack_signs);
- a codebook marker shared by a module group (e.g. ``…mlp.experts.mcg``) is copied to each linear;
- the output always has one ``model.safetensors.index.json``.
Normalizing a normalized checkpoint plans nothing and writes the same bytes (idempotent).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exl3tools.checkpoint.copy import copy_tensor
from exl3tools.checkpoint.header import DTYPES
from exl3tools.checkpoint.reader import INDEX_NAME, Checkpoint
from exl3tools.checkpoint.writer import (
    ShardWriter,
    copy_atomic,
    fsync_dir,
    index_json,
    json_bytes,
    refuse_overlap,
    write_atomic,
)
from exl3tools.errors import IncompatibleSliceError, OutputExistsError
from exl3tools.exl3 import BLOCK, MARKERS, unpack_signs

PROJ_RENAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PROJ = re.compile(r"(\.(?:mlp|experts\.\d+|shared_experts|shared_expert))\.(w1|w3|w2)\.")
_MTP = (re.compile(r"^(?:model\.)?(?:mtp|nextn)\.layers\.(\d+)\."),   # mtp.layers.0. / model.mtp.layers.0.
        re.compile(r"^(?:model\.)?(?:mtp|nextn)\.(?!layers\.)"))      # model.nextn.X (one tail layer)
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "bias", "mcg", "mul1", "scale")


@dataclass(frozen=True, slots=True)
class NTensor:
    name: str
    src: str
    dtype: str
    shape: tuple[int, ...]
    op: str = "copy"               # "copy" | "slice" | "unpack_signs"
    dim: int | None = None
    start: int | None = None
    stop: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][0]


@dataclass(frozen=True, slots=True)
class NormalizePlan:
    source: str
    actions: tuple[str, ...]                                   # human-readable, one per change
    shards: tuple[tuple[str, str, tuple[NTensor, ...]], ...]   # (source file, output file, tensors)
    renames: dict[str, str]                                    # old module/prefix -> new (for tensor_storage)

    @property
    def is_noop(self) -> bool:
        return not self.actions

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "noop": self.is_noop, "actions": list(self.actions),
                "files": [{"source": s, "output": o, "tensors": len(t)} for s, o, t in self.shards]}


def canonical_name(name: str, num_layers: int) -> str:
    m = _MTP[0].match(name)
    if m:
        name = f"model.layers.{num_layers + int(m.group(1))}." + name[m.end():]
    else:
        m = _MTP[1].match(name)
        if m:
            name = f"model.layers.{num_layers}." + name[m.end():]
    return _PROJ.sub(lambda mm: f"{mm.group(1)}.{PROJ_RENAMES[mm.group(2)]}.", name)


def plan_normalize(ck: Checkpoint) -> NormalizePlan:
    L = int(ck.config.get("num_hidden_layers", 0) or 0)
    actions: list[str] = []
    renames: dict[str, str] = {}
    names = set(ck.tensors)
    # shared markers: a 0-d marker whose prefix is not itself a linear but contains linears
    linear_prefixes = {n[: -len(".trellis")] for n in names if n.endswith(".trellis")
                       and len(ck.tensors[n].shape) == 3}
    shared_markers: dict[str, str] = {}      # group prefix -> marker tensor name
    for n in names:
        p, _, leaf = n.rpartition(".")
        if leaf in MARKERS and p not in linear_prefixes and ck.tensors[n].shape == ():
            shared_markers[p] = n
    canon_linears = {canonical_name(lp + ".x", L)[:-2] for lp in linear_prefixes}
    moved_mtp = False
    shards = []
    for fname in sorted(ck.headers):
        hd = ck.headers[fname]
        out: list[NTensor] = []
        for info in sorted(hd.tensors.values(), key=lambda t: t.begin):
            n = info.name
            p, _, leaf = n.rpartition(".")
            if p in shared_markers and shared_markers[p] == n:
                members = sorted(lp for lp in linear_prefixes if lp.startswith(p + ".")
                                 and not any(f"{lp}.{m}" in names for m in MARKERS))
                for lp in members:
                    out.append(NTensor(canonical_name(f"{lp}.{leaf}", L), n, info.dtype, ()))
                actions.append(f"marker {n} copied to {len(members)} linears under {p}")
                continue
            new = canonical_name(n, L)
            if new != n:
                np_, nl = new.rpartition(".")[0], leaf
                renames[p] = np_
                if not n.startswith("model.layers.") and new.startswith("model.layers."):
                    moved_mtp = True
                n2 = f"{np_}.{nl}"
            else:
                n2 = n
            base, _, lf = n2.rpartition(".")
            if base.endswith(".gate_up_proj") and base in canon_linears:
                out.extend(_split_fused(ck, n, base, lf))
                continue
            if lf in ("su", "sv") and p in linear_prefixes:
                k = info.shape[0] * 16
                out.append(NTensor(f"{base}.{'suh' if lf == 'su' else 'svh'}", n, "F16", (k,), "unpack_signs"))
                continue
            out.append(NTensor(n2, n, info.dtype, info.shape))
        shards.append((fname, fname, tuple(out)))
    for old, new in sorted(renames.items()):
        if ".gate_up_proj" not in new:
            actions.append(f"rename {old} -> {new}")
    if moved_mtp:
        actions.append(f"MTP/nextn tail moved to model.layers.{L}+")
    fused = sorted({t.src.rpartition(".")[0] for _, _, ts in shards for t in ts if t.op == "slice"})
    actions.extend(f"split fused {f} into gate_proj + up_proj" for f in fused)
    unpacked = sorted({t.src for _, _, ts in shards for t in ts if t.op == "unpack_signs"})
    actions.extend(f"unpack legacy {u} -> {'suh' if u.endswith('.su') else 'svh'}" for u in unpacked)
    if ck.index is None and len(ck.headers) >= 1 and not (ck.root / INDEX_NAME).exists():
        actions.append(f"write {INDEX_NAME}")
    outs = [t.name for _, _, ts in shards for t in ts]
    if len(outs) != len(set(outs)):
        dup = sorted({n for n in outs if outs.count(n) > 1})[:3]
        raise IncompatibleSliceError(f"normalizing would create duplicate tensor names: {dup}")
    return NormalizePlan(str(ck.root), tuple(actions), tuple(shards), renames)


def _split_fused(ck: Checkpoint, n: str, base: str, leaf: str) -> list[NTensor]:
    """gate_up_proj (n = 2*I columns) -> gate_proj [0, n/2) and up_proj [n/2, n), §8.2 column cut."""
    info = ck.tensors[n].info
    stem = base[: -len(".gate_up_proj")]
    src_prefix = n.rpartition(".")[0]
    width = ck.tensors[f"{src_prefix}.trellis"].shape[1] * 16
    half = width // 2
    if width % 2 or half % BLOCK:
        raise IncompatibleSliceError(f"{src_prefix}: fused width {width} does not split into two "
                                     f"128-aligned halves; cannot split it without requantization")
    out = []
    for j, proj in enumerate(("gate_proj", "up_proj")):
        a, b = j * half, (j + 1) * half
        name = f"{stem}.{proj}.{leaf}"
        if leaf == "trellis":
            out.append(NTensor(name, n, info.dtype, (info.shape[0], half // 16, info.shape[2]), "slice", 1,
                               a // 16, b // 16))
        elif leaf in ("svh", "bias"):
            out.append(NTensor(name, n, info.dtype, (half,), "slice", 0, a, b))
        elif leaf == "sv":
            out.append(NTensor(f"{stem}.{proj}.svh", n, "F16", (half,), "unpack_signs", 0, a // 16, b // 16))
        elif leaf == "su":
            out.append(NTensor(f"{stem}.{proj}.suh", n, "F16", (info.shape[0] * 16,), "unpack_signs"))
        else:  # suh, markers: shared by both halves
            out.append(NTensor(name, n, info.dtype, info.shape))
    return out


def _rename_storage(qcfg: dict, plan: NormalizePlan, out_shapes: dict[str, NTensor]) -> dict:
    ts = qcfg.get("tensor_storage")
    if not isinstance(ts, dict) or not plan.renames:
        return qcfg
    new_ts = {}
    for key, val in ts.items():
        nk = plan.renames.get(key, key)
        if nk.endswith(".gate_up_proj"):
            continue  # the halves are plain linears now; validate reads headers, not this map
        if isinstance(val, dict) and isinstance(val.get("stored_tensors"), dict):
            st = {}
            for tn, tv in val["stored_tensors"].items():
                p, _, lf = tn.rpartition(".")
                tn2 = f"{plan.renames.get(p, p)}.{lf}"
                st[tn2] = tv
            val = {**val, "stored_tensors": st}
        new_ts[nk] = val
    return {**qcfg, "tensor_storage": new_ts}


def apply_normalize(ck: Checkpoint, plan: NormalizePlan, dst: str | os.PathLike[str],
                    progress: Callable[[int], None] | None = None) -> None:
    """Write the normalized checkpoint to ``dst`` (temp names + rename; the index, then config.json last)."""
    dst = Path(dst)
    refuse_overlap(ck.root, dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise OutputExistsError(f"{dst}: exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    prog = progress or (lambda n: None)
    weight_map: dict[str, str] = {}
    total = 0
    for src_file, out_file, tensors in plan.shards:
        w = ShardWriter(dst / out_file, [(t.name, t.dtype, t.shape) for t in tensors])
        fd = os.open(ck.root / src_file, os.O_RDONLY)
        try:
            for t in tensors:
                info = ck.tensors[t.src].info
                if t.op == "unpack_signs":
                    packed = ck.read_numpy(t.src)
                    if t.dim is not None:
                        packed = packed[t.start:t.stop]
                    data = unpack_signs(packed).astype("<f2").tobytes()
                    w.write(data)
                    prog(len(data))
                else:
                    copy_tensor(fd, info.begin, info.shape, info.itemsize, [(w, t)], prog,
                                path=ck.root / src_file)
                weight_map[t.name] = out_file
                total += t.nbytes
            w.close()
        except BaseException:
            w.abort()
            raise
        finally:
            os.close(fd)
    out_shapes = {t.name: t for _, _, ts in plan.shards for t in ts}
    for p in sorted(ck.root.iterdir()):
        if not p.is_file() or p.name.endswith(".safetensors") or p.name in (INDEX_NAME, "config.json"):
            continue
        if p.name == "quantization_config.json" and plan.renames and ck.quantization_config_file:
            write_atomic(dst / p.name, json_bytes(_rename_storage(ck.quantization_config_file, plan, out_shapes), 4))
        else:
            copy_atomic(p, dst / p.name)
    write_atomic(dst / INDEX_NAME, index_json(dict(sorted(weight_map.items())), total))
    # config.json last: readers take a folder without an index (its shards globbed) for a checkpoint,
    # so a run killed before the index was done, without tokenizer files, validated OK; a folder
    # without config.json is no checkpoint to any reader
    copy_atomic(ck.root / "config.json", dst / "config.json")
    fsync_dir(dst)


def normalized_json(plan: NormalizePlan) -> str:
    return json.dumps(plan.to_json(), indent=2)


def unpacked_equal(packed: np.ndarray, suh: np.ndarray) -> bool:
    return bool(np.array_equal(unpack_signs(packed), suh.astype(np.float16)))
