"""E1xx structure: files, headers, index, config.json, quantization_config(.json) and tensor_storage.

open_tolerant reads a checkpoint as Checkpoint.open does, but turns every problem into a finding
instead of raising: validate must report every problem, and keep checking what is still readable.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

from exl3tools.checkpoint.header import SPLIT_HEADER_BYTES, Header, read_header
from exl3tools.checkpoint.jsonio import path_kind
from exl3tools.checkpoint.reader import (
    INDEX_NAME,
    Checkpoint,
    TensorRef,
    load_json,
    merge_quantization_config,
    nested_checkpoint_hint,
    unsafe_file_name,
)
from exl3tools.errors import CheckpointError, HeaderError, NotACheckpointError
from exl3tools.exl3 import CODEBOOKS, WIDTH_TO_K
from exl3tools.validate.context import Context
from exl3tools.validate.findings import Sink

LEGAL_K = set(WIDTH_TO_K.values())
TORCH_DTYPES = {"torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float64": "F64",
                "torch.int16": "I16", "torch.int32": "I32", "torch.int64": "I64", "torch.int8": "I8",
                "torch.uint8": "U8", "torch.bool": "BOOL", "torch.float8_e4m3fn": "F8_E4M3",
                "torch.float8_e5m2": "F8_E5M2"}
MULTIPLIERS = {"mcg_multiplier": ("mcg", 0xCBAC1FED), "mul1_multiplier": ("mul1", 0x83DCD12D)}


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ----------------------------------------------------------------------------- opening
def open_tolerant(root: Path, sink: Sink, defer_qfile: bool = False) -> tuple[Checkpoint, set[str]] | None:
    """Open ``root`` recording problems as findings; None when nothing is left to check.

    ``defer_qfile``: leave quantization_config.json (tens of MB of tensor_storage on GLM-5) unparsed
    when config.json carries the quantization_config; check_qfile_deferred parses and checks it later
    (in a worker process, in parallel with the other checks).
    """
    cfg_path, idx_path, qpath = root / "config.json", root / INDEX_NAME, root / "quantization_config.json"
    globbed = sorted(p.name for p in root.glob("*.safetensors"))
    cfg_kind, idx_kind, q_kind = path_kind(cfg_path), path_kind(idx_path), path_kind(qpath)
    if cfg_kind is None and not globbed and idx_kind is None:
        raise NotACheckpointError(f"{root}: no config.json and no *.safetensors: not a checkpoint directory"
                                  + nested_checkpoint_hint(root))

    config: dict[str, Any] = {}
    if cfg_kind is None:
        sink.add("E100", "config.json", None, "config.json missing" + nested_checkpoint_hint(root))
    else:  # a FIFO, device or directory is reported by the reader, never opened for reading
        config = _json_object(cfg_path, "config.json", "E100", sink) or {}

    qfile = None
    qcfg = config.get("quantization_config")
    deferred = defer_qfile and isinstance(qcfg, dict) and q_kind == "file"
    if q_kind is not None and not deferred:
        qfile = _json_object(qpath, "quantization_config.json", "E115", sink)
    if qcfg is not None and not isinstance(qcfg, dict):
        sink.add("E116", "config.json", None, "quantization_config is not an object")
        qcfg = None
    merged = merge_quantization_config(qfile, qcfg)

    index: dict[str, str] | None = None
    if idx_kind is not None:
        idx = _json_object(idx_path, INDEX_NAME, "E114", sink)
        wm = idx.get("weight_map") if idx is not None else None
        if idx is not None and not isinstance(wm, dict):
            sink.add("E114", INDEX_NAME, None, "no weight_map object")
        elif isinstance(wm, dict) and set(map(type, wm.values())) <= {str} and not any(
                map(unsafe_file_name, set(wm.values()))):
            index = dict(wm)  # every entry valid (JSON keys are str): what the loop below would keep
        elif isinstance(wm, dict):
            index = {}
            for name, fname in wm.items():
                if not (isinstance(name, str) and isinstance(fname, str)):
                    sink.add("E114", INDEX_NAME, str(name), f"weight_map entry {name!r}: {fname!r} is not a file name")
                elif unsafe_file_name(fname):
                    sink.add("E114", INDEX_NAME, name, f"weight_map names file {fname!r} outside the checkpoint")
                else:
                    index[name] = fname
    strays: list[str] = []
    if index is not None:
        files = sorted(set(index.values()))
        strays = sorted(set(globbed) - set(files))
    else:
        files = globbed
    if not files:
        sink.add("E101", "*.safetensors", None, "no safetensors files in the checkpoint")
        return None

    headers: dict[str, Header] = {}
    tensors: dict[str, TensorRef] = {}
    bad: set[str] = set()
    for fname in files:
        fpath = root / fname
        if path_kind(fpath) is None:
            sink.add("E110", fname, None, f"listed in {INDEX_NAME} but missing")
            bad.add(fname)
            continue
        try:
            h = read_header(fpath)
        except HeaderError as exc:
            code = getattr(exc, "code", "E104")
            msg = str(exc).split(": ", 1)[-1]
            if code == "E105":
                trunc = _truncation(fpath)
                if trunc:
                    code, msg = "E102", trunc
            sink.add_issue(code, f"{fpath}: {msg}")
            bad.add(fname)
            continue
        except OSError as exc:
            sink.add("E101", fname, None, f"cannot read: {exc.strerror or exc}")
            bad.add(fname)
            continue
        headers[fname] = h
        for code, msg in h.issues:
            sink.add_issue(code, msg)
        if tensors.keys().isdisjoint(h.tensors):  # no duplicates: build the refs at C speed
            tensors.update(zip(h.tensors, map(partial(TensorRef, fpath), h.tensors.values()), strict=True))
            continue
        for name, info in h.tensors.items():
            if name in tensors:
                sink.add("E113", fname, name, f"also stored in {tensors[name].file.name}")
                continue
            tensors[name] = TensorRef(fpath, info)

    if index is not None:
        for name, fname in index.items():
            if fname in headers and name not in headers[fname].tensors:
                where = tensors[name].file.name if name in tensors else None
                extra = f" (it is in {where})" if where else ""
                sink.add("E111", fname, name, f"listed in {INDEX_NAME} under this file but not in it{extra}")
        if not tensors.keys() <= index.keys():
            for name, ref in tensors.items():
                if name not in index:
                    sink.add("E112", ref.file.name, name, f"not listed in {INDEX_NAME} (loaders skip it)")
        _check_strays(root, strays, index, tensors, sink)
    ckpt = Checkpoint(root, config, merged, qfile, headers, tensors, index, [])
    if deferred:
        ckpt.issues.append(("deferred", str(qpath)))
    return ckpt, bad


def _check_strays(root: Path, strays: list[str], index: dict[str, str], tensors: dict[str, TensorRef],
                  sink: Sink) -> None:
    """Shards the index does not name. HF loaders and vLLM skip them, but exllamav3 loads every
    *.safetensors in the folder, a later file overriding an earlier one: a stray copy of an indexed
    tensor can silently replace it (E119); any other stray file is a W101."""
    for name in strays:
        try:
            h = read_header(root / name)
        except (HeaderError, OSError) as exc:
            sink.add("W101", name, None, f"not referenced by {INDEX_NAME}, and unreadable ({str(exc)[len(str(root / name)) + 2:]}); "
                     "exllamav3 loads every *.safetensors here: delete it")
            continue
        dup = [t for t in h.tensors if t in index]
        if dup:
            where = tensors[dup[0]].file.name if dup[0] in tensors else index[dup[0]]
            sink.add("E119", name, dup[0], f"not referenced by {INDEX_NAME}, but holds {len(dup)} indexed tensor(s) "
                     f"(this one is indexed in {where}); exllamav3 loads every *.safetensors here and the later "
                     "file wins: delete it")
        else:
            sink.add("W101", name, None, f"not referenced by {INDEX_NAME}: HF loaders and vLLM skip its "
                     f"{len(h.tensors)} tensor(s), exllamav3 loads them; delete it or add it to the index")


def _json_object(path: Path, what: str, code: str, sink: Sink) -> dict | None:
    try:
        obj = load_json(path, what)
    except (CheckpointError, OSError) as exc:
        sink.add(code, path.name, None, str(exc).split(": ", 1)[-1])
        return None
    if not isinstance(obj, dict):
        sink.add(code, path.name, None, f"{what} is not a JSON object")
        return None
    return obj


def _truncation(path: Path) -> str | None:
    """If a header parses as JSON and its tensors are contiguous but end past EOF: a truncated file."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > SPLIT_HEADER_BYTES:  # a real shard's header is a few MB: do not re-parse a hostile one
                return None
            obj = json.loads(f.read(n))
        size = os.path.getsize(path)
        ends = sorted((v["data_offsets"][0], v["data_offsets"][1]) for k, v in obj.items() if k != "__metadata__")
    except Exception:  # noqa: BLE001 - best effort refinement of an error already found
        return None
    pos = 0
    for b, e in ends:
        if b != pos:
            return None
        pos = e
    have = size - 8 - n
    if pos > have:
        return f"file truncated: header describes {pos} data bytes, file holds {have} ({pos - have} missing)"
    return None


# ----------------------------------------------------------------------------- quantization_config
def check_quant_config(ctx: Context) -> None:
    ck, add = ctx.ckpt, ctx.sink.add
    q = ck.quantization_config
    if q is None:
        add("E116", "config.json", None, "no quantization_config in config.json or quantization_config.json")
        return
    if q.get("quant_method") != "exl3":
        add("E116", "config.json", None, f"quant_method is {q.get('quant_method')!r}, not 'exl3'")
    bits = q.get("bits")
    if not (_is_num(bits) and 1 <= bits <= 8):
        add("E117", "config.json", None, f"bits {bits!r} is not a number in [1, 8]")
    for key in ("head_bits", "mtp_bits"):
        v = q.get(key)
        if key == "mtp_bits" and v is None:
            continue
        if not (_is_num(v) and (v in LEGAL_K or v == 16)):
            add("E117", "config.json", None, f"{key} {v!r} is not a legal K (1..8, 1.5, 2.5, 3.5) or 16")
    cb = q.get("codebook")
    if cb not in CODEBOOKS:
        add("E117", "config.json", None, f"codebook {cb!r} is not one of {', '.join(CODEBOOKS)}")

    head_bits = q.get("head_bits")
    head = ctx.scan.linears.get("lm_head")
    if head_bits == 16 and head is not None:
        add("E118", ctx.file_of("lm_head.trellis"), "lm_head", "head_bits is 16 (unquantized) but lm_head is EXL3")
    elif _is_num(head_bits) and head_bits != 16 and head is not None and head.bits is not None and head.bits != head_bits:
        add("E118", ctx.file_of("lm_head.trellis"), "lm_head", f"lm_head K is {head.bits:g} but head_bits is {head_bits:g}")
    mtp_bits = q.get("mtp_bits")
    if _is_num(mtp_bits) and mtp_bits != 16:
        wrong = [lin for lin in ctx.scan.linears.values()
                 if lin.family == "mtp" and lin.bits is not None and lin.bits != mtp_bits]
        for lin in wrong[:1]:
            add("E118", ctx.file_of(f"{lin.prefix}.trellis"), lin.prefix,
                f"MTP linear K is {lin.bits:g} but mtp_bits is {mtp_bits:g}"
                + (f" ({len(wrong)} MTP linears differ)" if len(wrong) > 1 else ""))


def qfile_deferred(ctx: Context) -> bool:
    return ("deferred", str(ctx.ckpt.root / "quantization_config.json")) in ctx.ckpt.issues


def check_qfile(ctx: Context) -> None:
    """quantization_config.json vs config.json (W102), presence of tensor_storage (W103), then E220/W201."""
    ck, add = ctx.ckpt, ctx.sink.add
    if qfile_deferred(ctx):
        ck.quantization_config_file = _json_object(ck.root / "quantization_config.json",
                                                   "quantization_config.json", "E115", ctx.sink)
    qcfg, qfile = ck.config.get("quantization_config"), ck.quantization_config_file
    if isinstance(qcfg, dict) and isinstance(qfile, dict):
        diff = sorted(k for k in (set(qcfg) | set(qfile)) - {"tensor_storage"} if qcfg.get(k) != qfile.get(k))
        if diff:
            add("W102", "quantization_config.json", None, f"differs from config.json quantization_config in {', '.join(diff)}")
    if ctx.rank is not None:
        pass  # rank dirs drop tensor_storage on purpose (docs/rank-slice.md §1)
    elif qfile is None and path_kind(ck.root / "quantization_config.json") is None:
        add("W103", None, None, "no quantization_config.json (vLLM's EXL3 backend requires its tensor_storage)")
    elif isinstance(qfile, dict) and not (isinstance(qfile.get("tensor_storage"), dict) and qfile["tensor_storage"]):
        add("W103", "quantization_config.json", None, "no tensor_storage (vLLM's EXL3 backend requires it)")
    check_tensor_storage(ctx)
    if isinstance(qfile, dict):  # can be ~100 MB of dicts on GLM-5: done with it
        qfile.pop("tensor_storage", None)


# ----------------------------------------------------------------------------- tensor_storage
def check_tensor_storage(ctx: Context) -> None:
    qfile = ctx.ckpt.quantization_config_file
    ts = qfile.get("tensor_storage") if isinstance(qfile, dict) else None
    if not isinstance(ts, dict) or not ts or ctx.rank is not None:
        return
    add, T = ctx.sink.add, ctx.ckpt.tensors
    QF = "quantization_config.json"
    listed: set[str] = set()
    for leaf, entry in ts.items():
        stored = entry.get("stored_tensors") if isinstance(entry, dict) else None
        if not isinstance(stored, dict):
            add("E220", QF, leaf, "tensor_storage entry has no stored_tensors object")
            continue
        missing = [n for n in stored if n not in T and not ctx.unreadable(n)]
        if missing and len(missing) == len(stored) and len(stored) > 1:
            add("E220", QF, leaf, f"tensor_storage lists {len(stored)} tensors of this module; no file stores any")
        else:
            for name in missing:
                add("E220", QF, name, "listed in tensor_storage but stored in no file")
        for name, meta in stored.items():
            ref = T.get(name)
            if ref is None:
                continue
            if not isinstance(meta, dict):
                add("E220", QF, name, "tensor_storage record is not an object")
                continue
            i = ref.info
            want_dt = TORCH_DTYPES.get(str(meta.get("dtype")))
            if want_dt is not None and want_dt != i.dtype:
                add("E220", QF, name, f"tensor_storage says {meta.get('dtype')}, file has {i.dtype}")
            if isinstance(meta.get("shape"), list) and tuple(meta["shape"]) != i.shape:
                add("E220", QF, name, f"tensor_storage shape {meta['shape']}, file has {list(i.shape)}")
            if _is_num(meta.get("n_bytes")) and meta["n_bytes"] != i.nbytes:
                add("E220", QF, name, f"tensor_storage n_bytes {meta['n_bytes']}, file has {i.nbytes}")
        if entry.get("quant_format") == "exl3":
            listed.add(leaf)
            lin = ctx.scan.linears.get(leaf)
            if lin is None:
                continue
            bpw = entry.get("bits_per_weight")
            if lin.bits is not None and _is_num(bpw) and bpw != lin.bits:
                add("E220", QF, leaf, f"bits_per_weight {bpw} but the trellis gives K {lin.bits:g}")
            cbs = [(MULTIPLIERS[k], entry[k]) for k in MULTIPLIERS if k in entry]
            want = cbs[0][0][0] if len(cbs) == 1 else "3inst" if not cbs else "both"
            if lin.codebook != want:
                add("E220", QF, leaf, f"tensor_storage says codebook {want}, the markers say {lin.codebook}")
            for (cb, value), got in cbs:
                if got != value:
                    add("E220", QF, leaf, f"{cb}_multiplier {got} is not {value}")
    for p, lin in ctx.scan.linears.items():
        if lin.family != "mtp" and p not in listed:
            add("W201", ctx.file_of(f"{p}.trellis"), p, "EXL3 linear not in tensor_storage (vLLM would treat it as unquantized)")
