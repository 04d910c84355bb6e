"""verify SRC SLICED: a rank-sliced output reassembles, byte for byte, to its source.

Checks (docs/rank-slice.md): the manifest exists (else IncompleteOutputError) and names this
source; every file has its recorded size and sha256; every rank tensor equals the source range its
manifest entry names; every source tensor is covered (whole somewhere, or its slices tile the cut
dim); every rank's config block agrees with the manifest; and for random 128x128 blocks of random
linears, decode(slice) equals the same block of decode(source).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exl3tools.checkpoint.jsonio import path_kind
from exl3tools.checkpoint.manifest import MANIFEST_NAME, load_manifest, sha256_file
from exl3tools.checkpoint.reader import Checkpoint, pread_exact
from exl3tools.errors import VerifyError
from exl3tools.slicing.plan import source_info

CHUNK = 64 << 20


@dataclass(slots=True)
class VerifyReport:
    tensors: int = 0
    bytes_compared: int = 0
    files_hashed: int = 0
    decode_blocks: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "tensors": self.tensors, "bytes_compared": self.bytes_compared,
                "files_hashed": self.files_hashed, "decode_blocks": self.decode_blocks,
                "problems": self.problems}


def _rows_equal(src: Checkpoint, out: Checkpoint, name: str, src_name: str, dim: int | None,
                a: int | None, b: int | None) -> tuple[bool, int]:
    """Compare an output tensor with its source range in bounded chunks of dim-0 rows."""
    o = out.ref(name).info
    s = src.ref(src_name).info
    shape = o.shape
    if not shape:
        x, y = src.read_bytes(src_name), out.read_bytes(name)
        return x == y, len(x)
    row_o = math.prod(shape[1:]) * o.itemsize
    row_s = math.prod(s.shape[1:]) * s.itemsize
    step = max(1, CHUNK // max(row_s, 1))
    for r0 in range(0, shape[0], step):
        r1 = min(shape[0], r0 + step)
        got = pread_exact(out.ref(name).file, o.begin + r0 * row_o, (r1 - r0) * row_o)
        if dim is None or dim != 0:
            raw = pread_exact(src.ref(src_name).file, s.begin + r0 * row_s, (r1 - r0) * row_s)
            if dim is None:
                exp = raw
            else:
                arr = np.frombuffer(raw, np.uint8).reshape((r1 - r0,) + s.shape[1:] + (s.itemsize,))
                idx = [slice(None)] * arr.ndim
                idx[dim] = slice(a, b)
                exp = np.ascontiguousarray(arr[tuple(idx)]).tobytes()
        else:
            exp = pread_exact(src.ref(src_name).file, s.begin + (a + r0) * row_s, (r1 - r0) * row_s)
        if got != exp:
            return False, o.nbytes
    return True, o.nbytes


def _codebook(ck: Checkpoint, prefix: str) -> str:
    return "mcg" if f"{prefix}.mcg" in ck else "mul1" if f"{prefix}.mul1" in ck else "3inst"


def decode_block(ck: Checkpoint, trellis: str, suh: str, svh: str, bi: int, bj: int, codebook: str) -> np.ndarray:
    """Original-basis W[128*bi : 128*bi+128, 128*bj : 128*bj+128] of one EXL3 linear."""
    from exl3tools.kernels.reference import decode_linear

    t = ck.read_numpy_slice(trellis, 0, bi * 8, bi * 8 + 8)[:, bj * 8:bj * 8 + 8, :]
    su = ck.read_numpy_slice(suh, 0, bi * 128, bi * 128 + 128)
    sv = ck.read_numpy_slice(svh, 0, bj * 128, bj * 128 + 128)
    return decode_linear(t, su, sv, codebook)


def verify_sliced(src: str | Path, sliced: str | Path, *, decode_samples: int = 4, seed: int = 0,
                  hash_files: bool = True, progress: Callable[[int], None] | None = None) -> VerifyReport:
    man = load_manifest(sliced)  # IncompleteOutputError when never finished
    sliced = Path(sliced)
    ck = Checkpoint.open(src)
    rep = VerifyReport()
    si = source_info(ck)
    if si.fingerprint != man.source.fingerprint:
        raise VerifyError(f"{sliced} was cut from a different source ({man.source.fingerprint[:19]}…, "
                          f"{src} is {si.fingerprint[:19]}…)")

    # a manifest is input too: it may only name paths inside SLICED
    for rel in list(man.files) + [r.dir for r in man.ranks]:
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or "\\" in rel:
            raise VerifyError(f"manifest.json names {rel!r}, a path outside {sliced}")

    # files: sizes and hashes; no unlisted safetensors
    for rel, fe in sorted(man.files.items()):
        p = sliced / rel
        kind = path_kind(p)
        if kind != "file":
            rep.problems.append(f"{rel}: listed in manifest.json but "
                                + ("missing" if kind is None else f"{kind}, not a regular file"))
            continue
        if p.stat().st_size != fe.size:
            rep.problems.append(f"{rel}: {p.stat().st_size} bytes, manifest says {fe.size}")
            continue
        if hash_files:
            if sha256_file(p) != fe.sha256:
                rep.problems.append(f"{rel}: sha256 differs from manifest.json")
            rep.files_hashed += 1
    for p in sliced.rglob("*.safetensors"):
        rel = p.relative_to(sliced).as_posix()
        if rel not in man.files:
            rep.problems.append(f"{rel}: not listed in {MANIFEST_NAME}")
    if rep.problems:
        raise VerifyError(f"{len(rep.problems)} problem(s); first: {rep.problems[0]}")

    covered: dict[str, list[tuple[int | None, int | None, int | None]]] = {}
    dequantized: set[str] = set()
    rng = np.random.default_rng(seed)
    for entry in man.ranks:
        rdir = sliced / entry.dir
        out = Checkpoint.open(rdir)
        if set(out.tensors) != set(entry.tensors):
            extra = sorted(set(out.tensors) - set(entry.tensors))[:3]
            miss = sorted(set(entry.tensors) - set(out.tensors))[:3]
            rep.problems.append(f"{entry.dir}: tensors differ from manifest (extra {extra}, missing {miss})")
            continue
        if man.layout == "ranks":
            block = out.config.get("exl3tools") or {}
            want = {"tp": man.tp, "rank": entry.rank, "moe": man.moe, "source_fingerprint": man.source.fingerprint}
            for k, v in want.items():
                if block.get(k) != v:
                    rep.problems.append(f"{entry.dir}/config.json: exl3tools.{k} = {block.get(k)!r}, expected {v!r}")
            _check_config_cuts(block, entry.tensors, entry.dir, rep)
        for name, (src_name, dim, a, b) in entry.tensors.items():
            sname = src_name or name
            if dim == "dequantize":
                dequantized.add(sname)
                continue
            if sname not in ck:
                rep.problems.append(f"{entry.dir}: {name}: source tensor {sname!r} not in {src}")
                continue
            s, o = ck.ref(sname).info, out.ref(name).info
            exp_shape = s.shape if dim is None else tuple(b - a if d == dim else x for d, x in enumerate(s.shape))
            if o.dtype != s.dtype or o.shape != exp_shape:
                rep.problems.append(f"{entry.dir}: {name}: {o.dtype}{list(o.shape)}, expected "
                                    f"{s.dtype}{list(exp_shape)}")
                continue
            same, n = _rows_equal(ck, out, name, sname, dim, a, b)
            rep.tensors += 1
            rep.bytes_compared += n
            if progress:
                progress(n)
            if not same:
                rep.problems.append(f"{entry.dir}: {name} differs from {sname}"
                                    + ("" if dim is None else f"[dim {dim}: {a}:{b}]"))
            covered.setdefault(sname, []).append((dim, a, b))
        _decode_checks(ck, out, entry.tensors, entry.dir, rng, decode_samples, rep)
        if man.layout == "vllm-hybrid" and dequantized:
            _dequant_checks(ck, out, entry.tensors, rng, decode_samples, rep)

    # coverage: every source tensor is somewhere, whole or tiled (not checkable when only some
    # ranks were written: rank-slice --ranks)
    partial = man.layout == "ranks" and len(man.ranks) < man.tp
    for name, info in ({} if partial else ck.tensors).items():
        if name.rpartition(".")[0] in dequantized:
            continue
        parts = covered.get(name)
        if not parts:
            rep.problems.append(f"source tensor {name} is in no rank")
            continue
        if any(d is None for d, _, _ in parts):
            continue
        dims = {d for d, _, _ in parts}
        if len(dims) != 1:
            rep.problems.append(f"source tensor {name} is cut along several dims {sorted(dims)}")
            continue
        d = dims.pop()
        pos = 0
        for a, b in sorted({(a, b) for _, a, b in parts}):
            if a > pos:
                break
            pos = max(pos, b)
        if pos < info.shape[d]:
            rep.problems.append(f"source tensor {name}: slices cover [0, {pos}) of {info.shape[d]} along dim {d}")
    if rep.problems:
        raise VerifyError(f"{len(rep.problems)} problem(s); first: {rep.problems[0]}")
    return rep


def _check_config_cuts(block: dict, tensors: dict, where: str, rep: VerifyReport) -> None:
    """The config block's cut of each linear must match its trellis entry in the manifest."""
    for mod, c in (block.get("modules") or {}).items():
        spec = tensors.get(f"{mod}.trellis")
        if spec is None or c.get("cut") not in ("column", "row"):
            continue
        want = [1 if c["cut"] == "column" else 0, c["first"] // 16, c["last"] // 16]
        if c["first"] == 0 and c["last"] == c["size"]:
            want = [None, None, None]
        if list(spec[1:]) != want:
            rep.problems.append(f"{where}/config.json: {mod} cut {c} disagrees with manifest {list(spec)}")


def _decode_checks(ck: Checkpoint, out: Checkpoint, tensors: dict, where: str, rng: np.random.Generator,
                   n: int, rep: VerifyReport) -> None:
    trellises = sorted(t for t in tensors if t.endswith(".trellis") and len(out.ref(t).shape) == 3)
    if not trellises or n <= 0:
        return
    for i in rng.choice(len(trellises), size=min(n, len(trellises)), replace=False):
        tname = trellises[int(i)]
        p = tname[: -len(".trellis")]
        src_t, dim, a, _b = tensors[tname]
        sp = (src_t or tname)[: -len(".trellis")]
        if f"{p}.suh" not in out or f"{p}.svh" not in out:
            continue  # legacy su/sv: covered by the byte comparison
        kt, nt, _ = out.ref(tname).shape
        bi, bj = int(rng.integers(kt // 8)), int(rng.integers(nt // 8))
        gi, gj = bi, bj
        if dim == 0:
            gi += a // 8
        elif dim == 1:
            gj += a // 8
        mine = decode_block(out, tname, f"{p}.suh", f"{p}.svh", bi, bj, _codebook(out, p))
        ref = decode_block(ck, f"{sp}.trellis", f"{sp}.suh", f"{sp}.svh", gi, gj, _codebook(ck, sp))
        rep.decode_blocks += 1
        if not np.array_equal(mine, ref):
            rep.problems.append(f"{where}: {p} block ({bi},{bj}) decodes differently from source block ({gi},{gj})")


def _dequant_checks(ck: Checkpoint, out: Checkpoint, tensors: dict, rng: np.random.Generator, n: int,
                    rep: VerifyReport) -> None:
    """vllm-hybrid: sampled 128x128 blocks of a dequantized .weight vs the source decode (bf16 tolerance)."""
    names = sorted(k for k, v in tensors.items() if v[1] == "dequantize")
    for i in rng.choice(len(names), size=min(n, len(names)), replace=False):
        name = names[int(i)]
        sp = tensors[name][0]
        out_f, in_f = out.ref(name).shape
        kt, nt, _ = ck.ref(f"{sp}.trellis").shape
        bi, bj = int(rng.integers(kt // 8)), int(rng.integers(nt // 8))
        ref = decode_block(ck, f"{sp}.trellis", f"{sp}.suh", f"{sp}.svh", bi, bj, _codebook(ck, sp))
        r0, r1 = bj * 128, min(out_f, bj * 128 + 128)
        c0, c1 = bi * 128, min(in_f, bi * 128 + 128)
        if r1 <= r0 or c1 <= c0:
            continue
        got = out.read_numpy_slice(name, 0, r0, r1)[:, c0:c1]
        exp = ref.T[: r1 - r0, : c1 - c0]
        tol = 2 ** -7 * max(float(np.abs(exp).max()), 1e-6)
        rep.decode_blocks += 1
        if not np.allclose(got, exp, rtol=2 ** -7, atol=tol):
            rep.problems.append(f"{name}: dequantized block ({bi},{bj}) differs from the source decode")
