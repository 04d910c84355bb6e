"""E5xx: rank-slice outputs (docs/rank-slice.md, format v1).

A set is ``DST/manifest.json`` + ``DST/rank-r-of-N/``. Checked: the manifest against its schema,
every listed file (size; sha256 for small files, for all with --deep), the rank dirs against ``tp``,
each rank's ``exl3tools`` config block, each rank's tensors against the manifest, the slices of one
tensor across ranks, and then each rank dir as a checkpoint whose expected modules are localized
to its slices (``context.localize``). A directory without its manifest is incomplete, never complete.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exl3tools.checkpoint.header import read_header
from exl3tools.checkpoint.jsonio import load_json, path_kind
from exl3tools.checkpoint.manifest import check_schema, read_manifest_json
from exl3tools.errors import CheckpointError, HeaderError, IncompleteOutputError
from exl3tools.validate.single import check_checkpoint

MANIFEST = "manifest.json"
RANK_DIR = re.compile(r"^rank-(\d+)-of-(\d+)$")
HASH_ALWAYS = 64 << 20     # files up to this size are hashed even in sampled mode
IGNORED = {MANIFEST, ".rank-slice.journal"}
EXL3_SLICED = ("trellis", "suh", "svh", "su", "sv")


def is_rank_set(root: Path) -> bool:
    """A rank-slice output: its manifest, rank dirs, or rank-slice's journal (an unfinished run)."""
    return (path_kind(root / MANIFEST) is not None or path_kind(root / ".rank-slice.journal") is not None
            or any(RANK_DIR.match(p.name) for p in root.iterdir() if p.is_dir()))


def _load_manifest(root: Path, sink) -> dict | None:
    p = root / MANIFEST
    try:
        obj = read_manifest_json(p)
    except (IncompleteOutputError, OSError) as exc:
        sink.add("E502", MANIFEST, None, _problem(exc, p))
        return None
    try:
        check_schema(obj)
    except IncompleteOutputError as exc:
        sink.add("E502", MANIFEST, None, str(exc).split(": ", 1)[-1])
        return None
    unsafe = [x for x in [*obj["files"], *(r["dir"] for r in obj["ranks"])] if not _inside(x)]
    if unsafe:  # a hostile manifest must not make validate read (hash) files outside DST
        sink.add("E502", MANIFEST, None, f"names paths outside the output directory: {unsafe[:3]}")
        return None
    return obj


def _inside(rel: str) -> bool:
    p = Path(rel)
    return not p.is_absolute() and ".." not in p.parts and "\\" not in rel


def _sha256(path: Path, tick: Callable[[int], None] | None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while b := f.read(16 << 20):
            h.update(b)
            if tick:
                tick(len(b))
    return h.hexdigest()


def _check_files(root: Path, man: dict, sink, deep: bool, progress) -> int:
    files = man["files"]
    total = sum(v["size"] for v in files.values()) if deep else 0
    tick = progress(total, len(files)) if (progress and deep) else None
    hashed = 0
    for rel, meta in sorted(files.items()):
        p = root / rel
        kind = path_kind(p)
        if kind != "file":
            sink.add("E503", rel, None, "listed in manifest.json but missing" if kind is None else
                     f"listed in manifest.json but {kind}, not a regular file")
            continue
        size = p.stat().st_size
        if size != meta["size"]:
            sink.add("E503", rel, None, f"size {size}, manifest.json says {meta['size']}")
            continue
        if deep or size <= HASH_ALWAYS:
            got = _sha256(p, tick)
            hashed += size
            if got != meta["sha256"]:
                sink.add("E503", rel, None, f"sha256 {got[:16]}..., manifest.json says {meta['sha256'][:16]}...")
    listed = set(files)
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        kind = path_kind(p)
        if kind not in (None, "a directory") and rel not in listed and p.name not in IGNORED:
            what = "" if kind == "file" else f" ({kind})"
            sink.add("W501", rel, None, f"not listed in manifest.json{what} (leftover temp file or foreign file?)")
    return hashed


def _config(path: Path) -> tuple[Any, str | None]:
    """(parsed config.json, None) or (None, the one-line problem); bounded, regular files only."""
    try:
        return load_json(path, "config.json"), None
    except (CheckpointError, OSError) as exc:
        return None, _problem(exc, path)


def _problem(exc: BaseException, path: Path) -> str:
    text = str(exc)
    return text[len(str(path)) + 2:] if text.startswith(f"{path}: ") else text


def _rank_config(root: Path, d: str) -> dict | None:
    cfg, _ = _config(root / d / "config.json")
    return cfg.get("exl3tools") if isinstance(cfg, dict) else None


def _check_rank_block(root: Path, man: dict, entry: dict, sink) -> None:
    d = entry["dir"]
    block = _rank_config(root, d)
    where = f"{d}/config.json" if d != "." else "config.json"
    if man["layout"] == "vllm-hybrid":
        return
    if not isinstance(block, dict):
        sink.add("E505", where, None, "no exl3tools block")
        return
    want = {"format": "exl3tools.rank-slice", "format_version": 1, "layout": man["layout"], "tp": man["tp"],
            "rank": entry["rank"], "moe": man["moe"], "source_fingerprint": man["source"]["fingerprint"]}
    for k, v in want.items():
        if block.get(k) != v:
            sink.add("E505", where, None, f"exl3tools.{k} is {block.get(k)!r}, manifest.json says {v!r}")


def _check_rank_tensors(root: Path, entry: dict, sink) -> dict[str, tuple[int, ...]]:
    """Tensors of one rank vs its manifest entry; returns name -> shape found."""
    d = entry["dir"]
    shapes: dict[str, tuple[int, ...]] = {}
    for p in sorted((root / d).glob("*.safetensors")):
        try:
            h = read_header(p)
        except (HeaderError, OSError):
            continue  # reported by the checkpoint checks of this rank dir
        shapes.update({n: t.shape for n, t in h.tensors.items()})
    specs = entry["tensors"]
    for name in sorted(set(specs) - set(shapes)):
        sink.add("E506", d, name, "in manifest.json but in no shard of this rank")
    for name in sorted(set(shapes) - set(specs)):
        sink.add("E506", d, name, "in a shard of this rank but not in manifest.json")
    for name, (_src, dim, start, stop) in specs.items():
        shape = shapes.get(name)
        if shape is None or not isinstance(dim, int):
            continue
        if dim >= len(shape) or shape[dim] != stop - start:
            sink.add("E506", d, name,
                     f"shape {list(shape)} but manifest.json slices dim {dim} [{start}, {stop})")
    return shapes


def _module_sizes(root: Path, man: dict) -> dict[str, int]:
    """module prefix -> padded size of its cut dim, from the ranks' exl3tools blocks."""
    sizes: dict[str, int] = {}
    for entry in man["ranks"]:
        block = _rank_config(root, entry["dir"])
        mods = block.get("modules") if isinstance(block, dict) else None
        for k, m in (mods or {}).items():
            if isinstance(m, dict) and isinstance(m.get("size"), int) and m.get("cut") in ("column", "row", "tp"):
                sizes.setdefault(k, m["size"])
    return sizes


def _expected_end(name: str, dim: int, sizes: dict[str, int]) -> int | None:
    prefix, _, suffix = name.rpartition(".")
    size = sizes.get(prefix)
    if size is None and ".mlp.experts." in prefix:
        size = sizes.get(prefix.split(".mlp.experts.")[0] + ".mlp.experts")
    if size is None:
        return None
    return size // 16 if suffix in ("trellis", "su", "sv") else size


def _check_slices(man: dict, shapes: dict[str, dict[str, tuple[int, ...]]], sink,
                  sizes: dict[str, int] | None = None) -> None:
    """Across ranks: one cut dim per tensor, pieces contiguous from 0, no overlap, 128-aligned EXL3 cuts."""
    pieces: dict[str, list[tuple[int, int, int, str]]] = defaultdict(list)
    whole: dict[str, list[tuple[str, tuple[int, ...] | None]]] = defaultdict(list)
    for entry in man["ranks"]:
        for name, (src, dim, start, stop) in entry["tensors"].items():
            key = src or name
            if isinstance(dim, int):
                pieces[key].append((dim, start, stop, entry["dir"]))
            elif dim is None:
                whole[key].append((entry["dir"], shapes.get(entry["dir"], {}).get(name)))
    tp = man["tp"]
    for name, ps in pieces.items():
        suffix = name.rsplit(".", 1)[-1]
        dims = {p[0] for p in ps}
        if len(dims) > 1:
            sink.add("E507", None, name, f"cut along different dims on different ranks ({sorted(dims)})")
            continue
        if name in whole:
            sink.add("E507", None, name, f"cut on {len(ps)} rank(s) but copied whole on {len(whole[name])}")
        ivs = sorted({(a, b) for _, a, b, _ in ps})
        pos, broken = 0, False
        for a, b in ivs:
            if a != pos:
                what = "gap" if a > pos else "overlap"
                sink.add("E507", None, name, f"{what} between slices at {pos}..{a} ({', '.join(f'[{x}, {y})' for x, y in ivs)})")
                broken = True
                break
            pos = b
        end = _expected_end(name, ps[0][0], sizes or {})
        if end is not None and pos != end and not broken:
            sink.add("E507", None, name, f"slices cover [0, {pos}) of {end} (the module's padded size)")
        unit = 8 if suffix == "trellis" else 128 if suffix in ("suh", "svh") else 1
        bad = [(a, b) for a, b in ivs if a % unit or (b % unit and b != pos)]
        if bad and suffix in EXL3_SLICED:
            sink.add("E507", None, name, f"slice {list(bad[0])} not 128-aligned ({unit} {'tiles' if unit == 8 else 'channels'})")
        if len(ps) > tp:
            sink.add("E507", None, name, f"{len(ps)} slices for tp {tp}")
    for name, holders in whole.items():
        got = {s for _, s in holders if s is not None}
        if len(got) > 1:
            sink.add("E507", None, name, f"replicated copies differ in shape across ranks: {sorted(got)}")


def check_rank_set(root: Path, sink, *, deep: bool, sample_blocks: int, progress, gpu: Any = None) -> dict[str, Any]:
    dirs = sorted((p.name for p in root.iterdir() if p.is_dir() and RANK_DIR.match(p.name)),
                  key=lambda n: int(RANK_DIR.match(n).group(1)))
    has_manifest = path_kind(root / MANIFEST) is not None
    man = _load_manifest(root, sink) if has_manifest else None
    stats: dict[str, Any] = {"rank_dirs": len(dirs)}
    if not has_manifest:
        sink.add("E501", MANIFEST, None, f"missing: {len(dirs)} rank dir(s) but no manifest, so this output "
                 "was never completed (rerun rank-slice with --resume)")
    if man is not None:
        stats.update(tp=man["tp"], layout=man["layout"], moe=man["moe"])
        stats["hashed_bytes"] = _check_files(root, man, sink, deep, progress)
        listed = [e["dir"] for e in man["ranks"]]
        if man["layout"] == "ranks":
            # tp is bounded by the ranks actually listed before anything is built from it
            want = [f"rank-{r}-of-{man['tp']}" for r in range(man["tp"])] if man["tp"] == len(listed) else None
            if want is None or sorted(listed) != sorted(want) or [e["rank"] for e in man["ranks"]] != list(range(man["tp"])):
                sink.add("E504", MANIFEST, None, f"ranks {listed} do not match tp {man['tp']}"
                         + (f" ({want})" if want else f" ({len(listed)} rank entries)"))
            for d in sorted(set(dirs) - set(listed)):
                sink.add("E504", d, None, "rank dir not in manifest.json")
        for entry in man["ranks"]:
            if not (root / entry["dir"]).is_dir():
                sink.add("E504", entry["dir"], None, "rank dir listed in manifest.json is missing")
                continue
            _check_rank_block(root, man, entry, sink)
        shapes = {e["dir"]: _check_rank_tensors(root, e, sink) for e in man["ranks"] if (root / e["dir"]).is_dir()}
        _check_slices(man, shapes, sink, _module_sizes(root, man))
        if man["layout"] == "vllm-hybrid":
            _check_hybrid(root, man, sink)
            return stats
        dirs = [e["dir"] for e in man["ranks"] if (root / e["dir"]).is_dir()]
    for d in dirs:
        kind = path_kind(root / d / "config.json")
        if kind == "file":
            sub = check_checkpoint(root / d, sink.child(d), deep=deep, sample_blocks=sample_blocks, progress=progress,
                                   gpu=gpu)
            for k in ("tensors", "linears", "bytes_read", "decoded_blocks", "decoded_linears"):
                if k in sub:
                    stats[k] = stats.get(k, 0) + sub[k]
            if "sha256" in sub:
                stats.setdefault("sha256", {}).update({f"{d}/{k}": v for k, v in sub["sha256"].items()})
        else:
            sink.add("E504", d, None, "rank dir has no config.json" if kind is None else
                     f"rank dir's config.json is {kind}, not a regular file")
    return stats


def _check_hybrid(root: Path, man: dict, sink) -> None:
    """vllm-hybrid (rank-sliced-formats.md §2.1): the hybrid_tr3_tail block the fork's loader requires."""
    cfg, problem = _config(root / "config.json")
    if problem is not None:
        sink.add("E505", "config.json", None, problem)
        return
    h = cfg.get("hybrid_tr3_tail") if isinstance(cfg, dict) else None
    if not isinstance(h, dict):
        sink.add("E505", "config.json", None, "no hybrid_tr3_tail block")
        return
    want = {"format": "exl3-trellis", "codebook": "mcg", "tp": man["tp"],
            "tensor_schema": "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"}
    for k, v in want.items():
        if h.get(k) != v:
            sink.add("E505", "config.json", None, f"hybrid_tr3_tail.{k} is {h.get(k)!r}, must be {v!r}")
    if h.get("bits") not in (3, 4, 5, 6, 3.0, 4.0, 5.0, 6.0):
        sink.add("E505", "config.json", None, f"hybrid_tr3_tail.bits {h.get('bits')!r} not in 3..6")


def check_lone_rank_dir(root: Path, sink) -> None:
    """``validate DST/rank-r-of-N``: the rank and its entry in DST/manifest.json."""
    m = RANK_DIR.match(root.resolve().name)
    block = _rank_config(root, ".")
    if not m and not (isinstance(block, dict) and block.get("format") == "exl3tools.rank-slice"):
        return
    parent = root.resolve().parent
    if path_kind(parent / MANIFEST) is None:
        sink.add("E508", "config.json", None, f"rank dir of a rank-slice set, but {parent / MANIFEST} is missing: "
                 "the set was never completed")
        return
    psink = type(sink)(parent)
    man = _load_manifest(parent, psink)
    if man is None:
        sink.add("E502", str(parent / MANIFEST), None, "the set's manifest.json is invalid")
        return
    entry = next((e for e in man["ranks"] if e["dir"] == root.resolve().name), None)
    if entry is None:
        sink.add("E504", ".", None, f"not listed in {parent / MANIFEST}")
        return
    sub = type(sink)(parent)
    _check_rank_block(parent, man, entry, sub)
    _check_rank_tensors(parent, entry, sub)
    prefix = entry["dir"] + "/"
    mine = {k: v for k, v in man["files"].items() if k.startswith(prefix)}
    _check_files(parent, {**man, "files": mine}, _Filter(sub, prefix), False, None)
    for f in sub.findings:
        rel = f.file[len(prefix):] if f.file and f.file.startswith(prefix) else f.file
        sink.add(f.code, rel, f.tensor, f.message)


class _Filter:
    """Forward only findings under ``prefix`` (a rank checked alone ignores its siblings' files)."""

    def __init__(self, sink, prefix: str):
        self.sink, self.prefix = sink, prefix

    def add(self, code, file, tensor, message):
        if file is None or str(file).startswith(self.prefix):
            self.sink.add(code, file, tensor, message)
