"""validate checks that need headers and JSON only: structure (E1xx), EXL3 linears (E2xx),
architecture completeness (E3xx), quantization_config / tensor_storage consistency.

open_tolerant reads a checkpoint as Checkpoint.open does, but turns every problem into a finding
instead of raising: validate must report every problem, and keep checking what is still readable.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from exl3tools.checkpoint.header import Header, read_header
from exl3tools.checkpoint.reader import (
    INDEX_NAME,
    Checkpoint,
    TensorRef,
    load_json,
    merge_quantization_config,
    unsafe_file_name,
)
from exl3tools.errors import CheckpointError, HeaderError, NotACheckpointError, UnsupportedArchitectureError
from exl3tools.exl3 import CODEBOOKS, WIDTH_TO_K
from exl3tools.layout import (
    Expected,
    Scan,
    expected_modules,
    expert_of,
    layer_of,
    pad128,
    scan_refs,
)
from exl3tools.validate import Sink

FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
LEGAL_K = set(WIDTH_TO_K.values())
TORCH_DTYPES = {"torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float64": "F64",
                "torch.int16": "I16", "torch.int32": "I32", "torch.int64": "I64", "torch.int8": "I8",
                "torch.uint8": "U8", "torch.bool": "BOOL", "torch.float8_e4m3fn": "F8_E4M3",
                "torch.float8_e5m2": "F8_E5M2"}
MULTIPLIERS = {"mcg_multiplier": ("mcg", 0xCBAC1FED), "mul1_multiplier": ("mul1", 0x83DCD12D)}
EXL3_PARTS = ("suh", "svh", "su", "sv", "mcg", "mul1", "scale")


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ----------------------------------------------------------------------------- opening
def open_tolerant(root: Path, sink: Sink, defer_qfile: bool = False) -> tuple[Checkpoint, set[str]] | None:
    """Open ``root`` recording problems as findings; None when nothing is left to check.

    ``defer_qfile``: leave quantization_config.json (tens of MB of tensor_storage on GLM-5) unparsed
    when config.json carries the quantization_config; check_qfile_deferred parses and checks it later
    (in a worker process, in parallel with the other checks).
    """
    cfg_path, idx_path = root / "config.json", root / INDEX_NAME
    globbed = sorted(p.name for p in root.glob("*.safetensors"))
    if not cfg_path.is_file() and not globbed and not idx_path.is_file():
        raise NotACheckpointError(f"{root}: no config.json and no *.safetensors: not a checkpoint directory")

    config: dict[str, Any] = {}
    if not cfg_path.is_file():
        sink.add("E100", "config.json", None, "config.json missing")
    else:
        config = _json_object(cfg_path, "config.json", "E100", sink) or {}

    qfile = None
    qpath = root / "quantization_config.json"
    qcfg = config.get("quantization_config")
    deferred = defer_qfile and isinstance(qcfg, dict) and qpath.is_file()
    if qpath.is_file() and not deferred:
        qfile = _json_object(qpath, "quantization_config.json", "E115", sink)
    if qcfg is not None and not isinstance(qcfg, dict):
        sink.add("E116", "config.json", None, "quantization_config is not an object")
        qcfg = None
    merged = merge_quantization_config(qfile, qcfg)

    index: dict[str, str] | None = None
    if idx_path.is_file():
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
    if index is not None:
        files = sorted(set(index.values()))
        for name in sorted(set(globbed) - set(files)):
            sink.add("W101", name, None, f"safetensors file not referenced by {INDEX_NAME} (loaders ignore it)")
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
        if not fpath.is_file():
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
    ckpt = Checkpoint(root, config, merged, qfile, headers, tensors, index, [])
    if deferred:
        ckpt.issues.append(("deferred", str(qpath)))
    return ckpt, bad


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


# ----------------------------------------------------------------------------- context
@dataclass
class Context:
    ckpt: Checkpoint
    sink: Sink
    bad_files: set[str]
    scan: Scan
    num_layers: int | None
    expected: list[Expected] | None
    real: dict[str, tuple[int, int]]
    mtp_layers: list[int]
    rank: dict | None = None                        # a rank dir's config.json "exl3tools" block
    padded: dict[str, tuple[int, int]] = field(default_factory=dict)  # rank slices: expected (k, n)
    broken: set[str] = field(default_factory=set)   # linear prefixes not safe to decode
    layer_file: dict[int | None, str] = field(default_factory=dict)

    @classmethod
    def build(cls, ckpt: Checkpoint, sink: Sink, bad: set[str]) -> Context:
        cfg = ckpt.config
        L = cfg.get("num_hidden_layers")
        L = L if isinstance(L, int) and not isinstance(L, bool) and L >= 0 else None
        sc = scan_refs(ckpt.tensors, L)
        mtp = [li for li in sorted(sc.layers) if L is not None and li >= L]
        expected = None
        if ckpt.config:
            try:
                expected = expected_modules(cfg, mtp)
            except UnsupportedArchitectureError as exc:
                msg = str(exc)
                if "lacks" in msg:
                    sink.add("E100", "config.json", None, msg)
                else:
                    sink.add("W301", "config.json", None, msg)
            except (TypeError, ValueError, AttributeError) as exc:
                sink.add("E100", "config.json", None, f"config values unusable ({type(exc).__name__}: {exc})")
        block = cfg.get("exl3tools")
        rank = block if isinstance(block, dict) and block.get("format") == "exl3tools.rank-slice" else None
        padded: dict[str, tuple[int, int]] = {}
        if rank is not None and expected is not None:
            from exl3tools.validate_ranks import localize

            expected, padded = localize(expected, rank)
        real = {e.name: (e.in_real, e.out_real) for e in expected or () if e.kind == "linear"}
        return cls(ckpt, sink, bad, sc, L, expected, real, mtp, rank, padded)

    def _layer_files(self) -> dict[int | None, str]:
        if not self.layer_file:  # built on first use: only missing tensors need it
            for n, r in self.ckpt.tensors.items():
                self.layer_file.setdefault(layer_of(n), r.file.name)
        return self.layer_file

    def file_of(self, name: str) -> str | None:
        ref = self.ckpt.tensors.get(name)
        return ref.file.name if ref else None

    def unreadable(self, name: str) -> bool:
        """Is ``name`` (a tensor or a module prefix) possibly in a file whose header failed?"""
        if not self.bad_files:
            return False
        idx = self.ckpt.index
        if idx is None:
            return True
        for n in (name, f"{name}.trellis", f"{name}.suh", f"{name}.weight"):
            if idx.get(n) in self.bad_files:
                return True
        return False

    def guess_file(self, name: str) -> str | None:
        if self.ckpt.index and name in self.ckpt.index:
            return self.ckpt.index[name]
        lf = self._layer_files()
        return lf.get(layer_of(name)) or lf.get(None)


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
    elif qfile is None and not (ck.root / "quantization_config.json").is_file():
        add("W103", None, None, "no quantization_config.json (vLLM's EXL3 backend requires its tensor_storage)")
    elif isinstance(qfile, dict) and not (isinstance(qfile.get("tensor_storage"), dict) and qfile["tensor_storage"]):
        add("W103", "quantization_config.json", None, "no tensor_storage (vLLM's EXL3 backend requires it)")
    check_tensor_storage(ctx)
    if isinstance(qfile, dict):  # can be ~100 MB of dicts on GLM-5: done with it
        qfile.pop("tensor_storage", None)


# ----------------------------------------------------------------------------- EXL3 linears
def check_linears(ctx: Context) -> None:
    ck, add, T = ctx.ckpt, ctx.sink.add, ctx.ckpt.tensors
    q = ck.quantization_config or {}
    cfg_cb = q.get("codebook") if q.get("codebook") in CODEBOOKS else None
    cb_mismatch: list[str] = []
    real_of, padded_of = ctx.real.get, ctx.padded.get
    for p, lin in ctx.scan.linears.items():
        ref = T[f"{p}.trellis"]
        tr = ref.info
        f = ref.file.name
        sufs = lin.suffixes  # exactly the EXL3 suffixes s with f"{p}.{s}" in T: no lookups for the absent ones
        broken = False
        if tr.dtype != "I16":
            add("E202", f, f"{p}.trellis", f"trellis dtype {tr.dtype}, must be I16")
            broken = True
        if lin.signs == "missing":
            have = [s for s in ("suh", "svh", "su", "sv") if s in lin.suffixes]
            need = [s for s in ("suh", "svh") if s not in lin.suffixes]
            add("E201", f, p, f"trellis without {' and '.join(need)}" + (f" (has {', '.join(have)})" if have else ""))
            broken = True
        elif lin.signs == "mixed":
            add("E219", f, p, f"mixes legacy su/sv with suh/svh ({', '.join(s for s in lin.suffixes if s[0] == 's')})")
            broken = True
        if lin.bits is None:
            add("E209", f, f"{p}.trellis", f"trellis last dim {lin.width} is not a legal K (16..128 step 16, 24, 40, 56)")
            broken = True
        elif lin.width in (24, 40, 56) and lin.codebook != "mul1":
            add("E210", f, f"{p}.trellis", f"half-integer K {lin.bits:g} requires the mul1 marker (codebook is {lin.codebook})")
            broken = True
        for s, dt, size in (("suh", "F16", lin.k), ("svh", "F16", lin.n), ("su", "I16", lin.k // 16), ("sv", "I16", lin.n // 16)):
            if s not in sufs:
                continue
            i = T[f"{p}.{s}"].info
            if i.dtype != dt or len(i.shape) != 1:
                add("E205", f, f"{p}.{s}", f"{s} is {i.dtype}{list(i.shape)}, must be {dt} rank 1")
                broken = True
            elif i.shape[0] != size:
                dim = "k" if s in ("suh", "su") else "n"
                add("E206", f, f"{p}.{s}", f"{s} length {i.shape[0]} but trellis {list(tr.shape)} gives {dim} -> {size}")
                broken = True
        if lin.k % 128 or lin.n % 128:
            add("E207", f, f"{p}.trellis", f"padded dims k={lin.k}, n={lin.n} are not multiples of 128")
            broken = True
        real = real_of(p)
        want = padded_of(p) or (real and (pad128(real[0]), pad128(real[1])))
        if want and (want[0] != lin.k or want[1] != lin.n):
            how = "this rank's slice is" if p in ctx.padded else f"config.json dims {real[0]} -> {real[1]} pad to"
            add("E208", f, f"{p}.trellis", f"trellis {list(tr.shape)} is k={lin.k}, n={lin.n}; "
                f"{how} k={want[0]}, n={want[1]}")
            broken = True
        for m in ("mcg", "mul1"):
            if m not in sufs:
                continue
            ref = T[f"{p}.{m}"]
            if ref.info.dtype != "I32" or ref.info.shape != ():
                add("E211", f, f"{p}.{m}", f"marker is {ref.info.dtype}{list(ref.info.shape)}, must be a 0-d I32")
                broken = True
        if lin.codebook == "both":
            add("E213", f, p, "has both mcg and mul1 markers")
            broken = True
        elif cfg_cb and lin.codebook != cfg_cb:
            cb_mismatch.append(p)
        b = T[f"{p}.bias"] if lin.has_bias else None
        if b is not None and (b.info.dtype != "F16" or b.info.shape != (lin.n,)):
            add("E217", f, f"{p}.bias", f"bias is {b.info.dtype}{list(b.info.shape)}, must be F16 [{lin.n}]")
        if "scale" in sufs:
            add("E218", f, f"{p}.scale", "legacy scale tensor present: exllamav3 1.6.5 ignores it, so the decode would be wrong")
        if broken:
            ctx.broken.add(p)

    if cb_mismatch:
        if len(cb_mismatch) == len(ctx.scan.linears) and len(cb_mismatch) > 1:
            got = Counter(ctx.scan.linears[p].codebook for p in cb_mismatch).most_common(1)[0][0]
            add("E214", "config.json", None, f"quantization_config.codebook is {cfg_cb!r} but every linear is {got}")
        else:
            for p in cb_mismatch:
                add("E214", ctx.file_of(f"{p}.trellis"), p,
                    f"codebook {ctx.scan.linears[p].codebook}, quantization_config.codebook is {cfg_cb}")

    # one codebook per layer; one K per (layer, projection) across experts
    by_layer: dict[int | None, list] = defaultdict(list)
    by_proj: dict[tuple[int | None, str], list] = defaultdict(list)
    for lin in ctx.scan.linears.values():
        if lin.codebook == "both":
            continue
        by_layer[lin.layer].append(lin)
        if lin.expert is not None:
            by_proj[(lin.layer, lin.prefix.rsplit(".", 1)[-1])].append(lin)
    for li, lins in by_layer.items():
        if li is None:
            continue
        counts = Counter(x.codebook for x in lins)
        if len(counts) > 1:
            major = counts.most_common(1)[0][0]
            summary = ", ".join(f"{c} x{n}" for c, n in counts.most_common())
            for x in lins:
                if x.codebook != major:
                    add("E215", ctx.file_of(f"{x.prefix}.trellis"), x.prefix,
                        f"layer {li} mixes codebooks ({summary}); this linear is {x.codebook}")
    for (li, proj), lins in by_proj.items():
        counts = Counter(x.width for x in lins)
        if len(counts) > 1:
            major = counts.most_common(1)[0][0]
            for x in lins:
                if x.width != major:
                    add("E216", ctx.file_of(f"{x.prefix}.trellis"), x.prefix,
                        f"K {WIDTH_TO_K.get(x.width, x.width / 16):g} but the other experts' {proj} in layer {li} "
                        f"have K {WIDTH_TO_K.get(major, major / 16):g}")

    # EXL3 parts with no (rank-3) trellis
    for n, (_dtype, shape) in ctx.scan.dense.items():
        prefix, _, suffix = n.rpartition(".")
        if suffix == "trellis":
            if not (len(shape) == 2 and f"{prefix}.signs" in T):
                add("E203", ctx.file_of(n), n, f"trellis shape {list(shape)} is not rank 3")
                if len(shape) != 2:
                    ctx.broken.add(prefix)
        elif suffix in EXL3_PARTS and prefix not in ctx.scan.linears and f"{prefix}.signs" not in T:
            if f"{prefix}.trellis" not in T:
                add("E204", ctx.file_of(n), n, f"{suffix} without {prefix}.trellis")


# ----------------------------------------------------------------------------- architecture
def check_architecture(ctx: Context) -> None:
    if ctx.expected is None:
        return
    ck, add, T, sc = ctx.ckpt, ctx.sink.add, ctx.ckpt.tensors, ctx.scan
    cfg = ck.config
    if ctx.bad_files and ck.index is None:
        add("W305", None, None, "completeness not checked: a file without an index could not be read")
        return
    skipped = 0
    covered: set[str] = set()
    for e in ctx.expected:
        if e.kind == "linear":
            lin = sc.linears.get(e.name)
            if lin is not None:
                covered.update(f"{e.name}.{s}" for s in lin.suffixes)
                if e.bias and not lin.has_bias:
                    add("E307", ctx.file_of(f"{e.name}.trellis"), e.name, "no bias but config.json says attention_bias")
                continue
            w = T.get(f"{e.name}.weight")
            if w is not None and f"{e.name}.trellis" not in T:  # unquantized linear (bitrate 16)
                covered.update({f"{e.name}.weight", f"{e.name}.bias"})
                _check_dense(ctx, f"{e.name}.weight", (e.out_real, e.in_real))
                continue
            if ctx.unreadable(e.name):
                skipped += 1
                continue
            code = "E309" if e.mtp else "E303" if expert_of(e.name) is not None else "E301"
            what = "MTP layer linear" if e.mtp else "expert projection" if code == "E303" else "linear"
            add(code, ctx.guess_file(e.name), e.name,
                f"{what} missing ({e.in_real} -> {e.out_real}; no .trellis or .weight)")
        else:
            if e.name in T:
                covered.add(e.name)
                _check_dense(ctx, e.name, e.shape)
            elif (e.name == "model.embed_tokens.weight" and "model.embed_tokens.trellis" in T
                  and "model.embed_tokens.signs" in T):
                covered.update({"model.embed_tokens.trellis", "model.embed_tokens.signs"})
            elif ctx.unreadable(e.name):
                skipped += 1
            else:
                code = "E309" if e.mtp else "E302"
                add(code, ctx.guess_file(e.name), e.name,
                    f"{'MTP layer tensor' if e.mtp else 'tensor'} missing (expected {list(e.shape) or 'dense'})")
    if skipped:
        add("W305", None, None, f"{skipped} expected modules not checked: their files could not be read")
    for n in T:
        if n not in covered:
            add("W302", ctx.file_of(n), n, "unexpected tensor: no loader for this architecture reads it")

    nextn = cfg.get("num_nextn_predict_layers") or 0
    nextn = nextn if isinstance(nextn, int) else 0
    L = ctx.num_layers
    if L is None:
        return
    if nextn > 0 and not ctx.mtp_layers:
        add("W303", "config.json", None, f"num_nextn_predict_layers is {nextn} but no MTP layer "
            f"(model.layers.{L}.*) is stored: the quant dropped it, speculative decoding is unavailable")
    for li in ctx.mtp_layers:
        if li >= L + nextn:
            add("W304", ctx._layer_files().get(li), f"model.layers.{li}",
                f"layer {li} is beyond num_hidden_layers {L} + num_nextn_predict_layers {nextn}")


def _check_dense(ctx: Context, name: str, shape: tuple[int, ...]) -> None:
    i = ctx.ckpt.tensors[name].info
    f = ctx.file_of(name)
    if i.dtype not in FLOAT_DTYPES:
        ctx.sink.add("E305", f, name, f"dtype {i.dtype}, expected a float dtype (BF16/F16/F32)")
    if shape and i.shape != tuple(shape):
        ctx.sink.add("E304", f, name, f"shape {list(i.shape)}, expected {list(shape)}")


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
