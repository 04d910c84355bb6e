"""validate --deep: read every byte once: sha256 of every file, every dense tensor, a full decode of
every linear (on worker threads, bounded queue). The per-tensor checks are numeric.py's."""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from exl3tools.checkpoint.reader import to_numpy
from exl3tools.kernels.reference import decode_linear
from exl3tools.validate.context import Context
from exl3tools.validate.numeric import Checks, _codebook, _small_reads

CHUNK = 64 << 20            # bytes per read of bytes nobody interprets
DENSE_CHUNK = 16 << 20      # dense bytes checked per step (float32 copy: 2-4x this)
DECODE_BYTES = 2 << 20      # trellis bytes decoded per step (W float32: ~10x this)



def check_deep(ctx: Context, progress: Callable[[int, int], Callable[[int], None]] | None,
               gpu: Any = None) -> dict[str, Any]:
    """``gpu``: a kernels.gpu_decode.GpuDecoder (same W bit for bit), or None for the CPU reference."""
    checks = Checks(ctx, None)
    ck, T = ctx.ckpt, ctx.ckpt.tensors
    total = sum(h.file_size for h in ck.headers.values())
    tick = progress(total, len(ck.headers)) if progress else None
    # small tensors go through the same checks as sampled mode (whole tensors, no windows)
    handlers = {(path, r.offset): r for path, rs in _small_reads(ctx).items() for r in rs}
    hashes: dict[str, str] = {}
    nbytes = 0
    by_file: dict[Path, list[tuple[int, int, str]]] = defaultdict(list)
    for n, r in T.items():
        by_file[r.file].append((r.info.begin, r.info.end, n))
    try:
        for fname in sorted(ck.headers):
            h = ck.headers[fname]
            path = ck.root / fname
            sha = hashlib.sha256()
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                ctx.sink.add("E410", fname, None, f"cannot open: {exc.strerror or exc}")
                continue
            try:
                def read(off: int, n: int, fd: int = fd, sha: Any = sha) -> bytes:
                    buf = os.pread(fd, n, off)
                    if len(buf) != n:
                        raise EOFError(f"file ends before byte {off + n}")
                    sha.update(buf)
                    if tick:
                        tick(len(buf))
                    return buf

                pos = 0
                try:
                    pos = _stream(read, 0, h.data_start)
                    for begin, end, name in sorted(by_file[path]):
                        if begin > pos:
                            pos = _stream(read, pos, begin)
                        _deep_tensor(ctx, checks, name, path, begin, end, read, handlers, gpu)
                        pos = max(pos, end)
                    pos = _stream(read, pos, h.file_size)
                except EOFError as exc:
                    ctx.sink.add("E410", fname, None, str(exc))
                except OSError as exc:
                    ctx.sink.add("E410", fname, None, f"read failed: {exc.strerror or exc}")
                nbytes += pos
                hashes[fname] = sha.hexdigest()
            finally:
                os.close(fd)
    finally:
        checks.drain()
    checks.flush()
    checks.finish_decode()
    return {"bytes_read": nbytes, "decoded_linears": checks.decoded, "sha256": hashes}


def _decode_check(checks: Checks, prefix: str, tr: np.ndarray, suh: np.ndarray, svh: np.ndarray, cb: str,
                  gpu: Any = None) -> None:
    checks.decoded_block(prefix, (gpu.decode_linear if gpu is not None else decode_linear)(tr, suh, svh, cb))


def _stream(read: Callable[[int, int], bytes], start: int, stop: int) -> int:
    pos = start
    while pos < stop:
        n = min(CHUNK, stop - pos)
        read(pos, n)
        pos += n
    return pos


def _deep_tensor(ctx, checks: Checks, name: str, path: Path, begin: int, end: int, read,
                 handlers: dict, gpu: Any = None) -> None:
    info = ctx.ckpt.tensors[name].info
    prefix, _, suffix = name.rpartition(".")
    lin = ctx.scan.linears.get(prefix) if suffix == "trellis" else None
    if lin is not None and prefix not in ctx.broken:
        kt, nt, width = info.shape
        row_bytes = nt * width * 2
        # 8 tile rows (one 128-row block) at a time at least; ~DECODE_BYTES of trellis per step
        rows_per = max(8, (DECODE_BYTES // max(1, row_bytes)) // 8 * 8)
        suh = checks.vectors.pop(f"{prefix}.suh", None)
        svh = checks.vectors.pop(f"{prefix}.svh", None)
        if suh is None or svh is None:  # sign vectors stored after the trellis: read them now
            suh = to_numpy(ctx.ckpt.read_bytes(f"{prefix}.suh"), "F16", (-1,))
            svh = to_numpy(ctx.ckpt.read_bytes(f"{prefix}.svh"), "F16", (-1,))
        for r0 in range(0, kt, rows_per):
            r1 = min(kt, r0 + rows_per)
            raw = read(begin + r0 * row_bytes, (r1 - r0) * row_bytes)
            if r1 == kt:
                checks.trellis_strip(prefix, raw[-8 * width * 2:])
            if (r1 - r0) % 8 == 0:
                tr = np.frombuffer(raw, dtype="<i2").reshape(r1 - r0, nt, width)
                checks.submit(_decode_check, checks, prefix, tr, suh[16 * r0:16 * r1], svh, _codebook(lin), gpu)
        checks.decoded += 1
        return
    handler = handlers.get((path, begin))
    if handler is not None and handler.length == info.nbytes:
        checks.dispatch(handler, read(begin, info.nbytes))
        return
    if info.dtype in ("F16", "BF16", "F32", "F64") and info.nbytes > 0:
        item = info.itemsize
        step = max(item, DENSE_CHUNK // item * item)
        for a in range(begin, end, step):
            checks.dense(name, info.dtype, read(a, min(step, end - a)), False)
        return
    _stream(read, begin, end)
