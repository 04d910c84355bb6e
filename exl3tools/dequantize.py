"""dequantize: EXL3 checkpoint -> plain Hugging Face checkpoint (every linear decoded to P.weight).

Streaming: each linear is decoded in slabs of output channels, which are contiguous rows of the HF
``(out, in)`` weight, so memory stays bounded by one slab whatever the model size. Shards are
grouped by top-level module (embedding, each decoder layer, head); the index, then config.json come last.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exl3tools.checkpoint import Checkpoint
from exl3tools.checkpoint.copy import WHOLE, copy_tensor
from exl3tools.checkpoint.writer import (
    ShardWriter,
    copy_atomic,
    fsync_dir,
    index_json,
    refuse_overlap,
    write_atomic,
)
from exl3tools.errors import CheckpointError, MissingTensorError, OutputExistsError, UsageError
from exl3tools.exl3 import unpack_signs
from exl3tools.inspect import require_exl3
from exl3tools.layout import layer_of, real_dims, scan_refs

OUT_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
SLAB_COLUMNS = 2048  # output channels decoded at once: k * 2048 * 4 B = 50 MB at k = 6144


@dataclass(frozen=True, slots=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    source: str            # "linear" (decode P), "bias" (crop P.bias), "copy" (bytes as they are)
    key: str               # linear prefix or source tensor name
    nbytes: int


@dataclass(frozen=True, slots=True)
class DequantPlan:
    src: str
    dst: str
    dtype: str
    shards: tuple[tuple[str, tuple[OutTensor, ...]], ...]   # (file name, tensors in order)
    padded_dims_used: tuple[str, ...]                        # linears of unknown arch: padded dims kept

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for _, ts in self.shards for t in ts)

    def describe(self) -> list[str]:
        lines = [f"dequantize {self.src} -> {self.dst} as {self.dtype}: {len(self.shards)} shards, "
                 f"{self.total_bytes / 1e6:.1f} MB"]
        for fname, ts in self.shards:
            n_lin = sum(t.source == "linear" for t in ts)
            lines.append(f"  {fname}: {len(ts)} tensors ({n_lin} decoded), {sum(t.nbytes for t in ts) / 1e6:.1f} MB")
        if self.padded_dims_used:
            lines.append(f"  warning: unknown real dims, padded dims kept for {len(self.padded_dims_used)} linears")
        return lines


def _group(name: str) -> str:
    li = layer_of(name)
    if li is not None:
        return f"layer{li:05d}"
    return "embed" if "embed" in name else "head"


def plan_dequantize(ck: Checkpoint, dst: str | Path, dtype: str = "bf16", only: list[str] | None = None) -> DequantPlan:
    if dtype not in OUT_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(OUT_DTYPES)}")
    require_exl3(ck)
    refuse_overlap(ck.root, dst)
    odt = OUT_DTYPES[dtype]
    isz = {"BF16": 2, "F16": 2, "F32": 4}[odt]
    sc = scan_refs(ck.tensors, ck.config.get("num_hidden_layers"))
    dims = real_dims(ck.config, ck.tensors)
    wanted = None
    if only:
        wanted = {k.removesuffix(".weight").removesuffix(".trellis") for k in only}
        unknown = [k for k in wanted if k not in sc.linears and k not in ck.tensors]
        if unknown:
            raise MissingTensorError(f"{ck.root}: no tensor or EXL3 linear {unknown[0]!r}")
    _refuse_broken_linears(ck, wanted)
    groups: dict[str, list[OutTensor]] = {}
    padded: list[str] = []
    for p, lin in sc.linears.items():
        if wanted is not None and p not in wanted:
            continue
        i_r, o_r = dims.get(p, (lin.k, lin.n))
        if p not in dims:
            padded.append(p)
        groups.setdefault(_group(p), []).append(OutTensor(f"{p}.weight", odt, (o_r, i_r), "linear", p, o_r * i_r * isz))
        if lin.has_bias:
            groups[_group(p)].append(OutTensor(f"{p}.bias", odt, (o_r,), "bias", p, o_r * isz))
    for n, (dt, shape) in sc.dense.items():
        if wanted is not None and n not in wanted:
            continue
        groups.setdefault(_group(n), []).append(OutTensor(n, dt, tuple(shape), "copy", n, ck.tensors[n].info.nbytes))
    order = sorted(groups, key=lambda g: (g != "embed", g == "head", g))
    n = len(order)
    shards = tuple((f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(sorted(groups[g], key=lambda t: t.name)))
                   for i, g in enumerate(order))
    return DequantPlan(str(ck.root), str(dst), dtype, shards, tuple(padded))


def _checked_linears(ck: Checkpoint) -> tuple[list, set[str]]:
    """validate's EXL3-linear rules (E2xx) over ``ck``'s headers: (their findings, the linears
    they mark as not safe to decode)."""
    from exl3tools.validate.context import Context
    from exl3tools.validate.findings import Sink
    from exl3tools.validate.linears import check_linears

    sink = Sink(ck.root)
    ctx = Context.build(ck, sink, set())
    check_linears(ctx)
    return sink.findings, ctx.broken


def _under(tensor: str | None, prefixes: set[str]) -> bool:
    """A finding's tensor is one of ``prefixes``' linears or a part of one."""
    return any(tensor == p or (tensor or "").startswith(f"{p}.") for p in prefixes)


def _refuse_broken_linears(ck: Checkpoint, wanted: set[str] | None) -> None:
    """validate's EXL3-linear rules (E2xx), run on the linears about to be decoded: a trellis of the
    wrong dtype or rank, sign vectors that do not fit it, or config dims its padding cannot hold would
    decode to wrong weights without any error. Refused, with the first finding."""
    findings, _ = _checked_linears(ck)
    bad = [f for f in findings if f.severity == "error" and f.code.startswith("E2")
           and (wanted is None or _under(f.tensor, wanted))]
    if bad:
        more = f" (and {len(bad) - 1} more; exl3tools validate lists them)" if len(bad) > 1 else ""
        raise CheckpointError(f"{ck.root}: {bad[0].line}{more}: dequantizing it would write wrong weights")


def refuse_undecodable(ck: Checkpoint, prefixes: set[str]) -> None:
    """The linears of ``prefixes`` that validate's E2xx rules mark as not safe to decode (a part of
    the wrong dtype, rank or length, an illegal K, both markers): the reference decoder would stop
    with a bare ValueError (exit 70) or decode garbage. ``inspect --tensor`` and ``diff`` decode
    such linears for a look, so only these are refused (not a K that differs from the other
    experts'), in one line naming the file and the first finding."""
    findings, broken = _checked_linears(ck)
    bad = sorted(broken & prefixes)
    if bad:
        f = next((f for f in findings if _under(f.tensor, {bad[0]})), None)
        what = f.line if f is not None else f"{bad[0]}: malformed EXL3 linear"
        more = f" (and {len(bad) - 1} more linears; exl3tools validate lists them)" if len(bad) > 1 else ""
        raise CheckpointError(f"{ck.root}: {what}{more}: it cannot be decoded")


def to_dtype_bytes(x: np.ndarray, odt: str) -> bytes:
    if odt == "F32":
        return np.ascontiguousarray(x, dtype="<f4").tobytes()
    if odt == "F16":
        return np.ascontiguousarray(x, dtype="<f2").tobytes()
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)  # RNE
    return rounded.astype("<u2").tobytes()


def _fields(ck: Checkpoint, p: str) -> tuple[np.ndarray, np.ndarray, str]:
    names = ck.tensors
    suh = ck.read_numpy(f"{p}.suh") if f"{p}.suh" in names else unpack_signs(ck.read_numpy(f"{p}.su"))
    svh = ck.read_numpy(f"{p}.svh") if f"{p}.svh" in names else unpack_signs(ck.read_numpy(f"{p}.sv"))
    codebook = "mcg" if f"{p}.mcg" in names else "mul1" if f"{p}.mul1" in names else "3inst"
    return suh, svh, codebook


def _slabs(ck: Checkpoint, p: str, o_r: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """(first output channel, padded end, trellis columns) per ``SLAB_COLUMNS`` slab."""
    for c0 in range(0, o_r, SLAB_COLUMNS):
        c1 = min(c0 + SLAB_COLUMNS, -(-o_r // 128) * 128)
        yield c0, c1, ck.read_numpy_slice(f"{p}.trellis", 1, c0 // 16, c1 // 16)


def linear_rows(ck: Checkpoint, p: str, shape: tuple[int, int]) -> Iterator[np.ndarray]:
    """HF weight rows (output channels) of EXL3 linear p at real ``shape`` (out, in), float32,
    ``SLAB_COLUMNS`` rows at a time (bounded memory); ``exl3tools diff`` reads the same slabs."""
    from exl3tools.kernels.reference import decode_linear

    o_r, i_r = shape
    suh, svh, codebook = _fields(ck, p)
    for c0, c1, tr in _slabs(ck, p, o_r):
        w = decode_linear(tr, suh, svh[c0:c1], codebook)
        yield w[:i_r, : min(c1, o_r) - c0].T


def _linear_slabs(ck: Checkpoint, p: str, shape: tuple[int, int], odt: str, gpu=None) -> Iterator[bytes]:
    if gpu is None:
        for rows in linear_rows(ck, p, shape):
            yield to_dtype_bytes(rows, odt)
        return
    # the same slabs decoded on the GPU, cropped and rounded there: the bytes equal the CPU path's
    o_r, i_r = shape
    suh, svh, codebook = _fields(ck, p)
    for c0, c1, tr in _slabs(ck, p, o_r):
        yield gpu.hf_rows_bytes(tr, suh, svh[c0:c1], codebook, min(c1, o_r) - c0, i_r, odt)


def apply_dequantize(plan: DequantPlan, ck: Checkpoint, *, overwrite: bool = False,
                     progress: Callable[[int], None] | None = None, gpu=None) -> Path:
    """Write the plan. ``gpu``: a kernels.gpu_decode.GpuDecoder to decode on (same bytes), or None (CPU)."""
    dst = Path(plan.dst)
    refuse_overlap(ck.root, dst)
    if dst.exists() and not dst.is_dir():
        raise OutputExistsError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()):
        # --overwrite replaces a checkpoint, finished or not (shards without config.json: a killed
        # run), not any folder
        finished = (dst / "config.json").is_file()
        if not finished and not any(dst.glob("*.safetensors")):
            raise OutputExistsError(f"{dst}: a non-empty folder that is not a checkpoint; choose an empty or new DST")
        if not overwrite:
            raise OutputExistsError(f"{dst}: already holds a{'' if finished else 'n unfinished'} checkpoint "
                                    "(use --overwrite)")
        # the old checkpoint stops being one before its shards are replaced: a run killed midway left
        # new and old shards (fp32 beside bf16) under the old config and index, complete to any reader
        (dst / "config.json").unlink(missing_ok=True)
        (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for fname, tensors in plan.shards:
        w = ShardWriter(dst / fname, [(t.name, t.dtype, t.shape) for t in tensors])
        try:
            for t in tensors:
                if t.source == "linear":
                    for chunk in _linear_slabs(ck, t.key, t.shape, t.dtype, gpu):  # type: ignore[arg-type]
                        w.write(chunk)
                elif t.source == "bias":
                    w.write(to_dtype_bytes(ck.read_numpy(f"{t.key}.bias")[: t.shape[0]].astype(np.float32), t.dtype))
                else:  # in chunks: a dense tensor read whole (GLM-5's 1.9 GB embedding) set the peak RSS
                    ref = ck.ref(t.key)
                    with open(ref.file, "rb", buffering=0) as f:
                        copy_tensor(f.fileno(), ref.info.begin, ref.info.shape, ref.info.itemsize,
                                    [(w, WHOLE)], lambda n: None, path=ref.file)
                weight_map[t.name] = fname
                if progress:
                    progress(t.nbytes)
            w.close()
        except BaseException:
            w.abort()
            raise
    for f in ck.tokenizer_files():
        copy_atomic(f, dst / f.name)
    config = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    config["torch_dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[plan.dtype]
    config["dtype"] = config["torch_dtype"]
    config.setdefault("exl3tools", {})
    config["exl3tools"] = {"dequantized_from": str(ck.root), "source_quantization": ck.quantization_config}
    write_atomic(dst / "model.safetensors.index.json", index_json(weight_map, plan.total_bytes))
    # config.json last: a folder without it is no checkpoint to any reader, while one without an
    # index is (its shards globbed)
    write_atomic(dst / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    fsync_dir(dst)
    return dst
