"""validate numeric checks (E4xx) and the marker values (E212).

Sampled mode (the default) reads only small ranges, coalesced into few preads: every sign vector,
marker and bias; every small dense tensor (a 1 MiB window of large ones); one 8-tile strip of a
sampled 128x128 block of every trellis (all-zero bytes there mean the data were never written);
and decodes that block for up to ``sample_blocks`` linears with kernels/reference.py.
Deep mode (deep.py) runs the same per-tensor checks (class Checks) on every byte.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import zlib
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exl3tools.checkpoint.header import DTYPES
from exl3tools.checkpoint.reader import to_numpy
from exl3tools.exl3 import MARKERS
from exl3tools.kernels.reference import decode_rotated, had_cols, had_rows
from exl3tools.validate.context import Context
from exl3tools.validate.structure import check_qfile

DENSE_SAMPLE = 1 << 20      # bytes read from one dense tensor in sampled mode
MERGE_GAP = 64 << 10        # coalesce reads separated by less than this
MERGE_MAX = 16 << 20        # largest coalesced read
FP16_MAX = 65504.0
MAX_PROCS = int(os.environ.get("EXL3TOOLS_VALIDATE_PROCS", "16"))
FORK_MIN_TENSORS = 20_000  # below this a process pool costs more than it saves
DECODE_THREADS = max(1, min(8, os.cpu_count() or 1))
NORM_SUFFIXES = ("norm.weight",)


@dataclass(slots=True)
class _Read:
    offset: int
    length: int
    kind: str   # "sign" | "bias" | "marker" | "dense" | "strip" | "block"
    key: Any


def _read_all(path: Path, reads: list[_Read], ctx: Context, dispatch: Callable[[_Read, bytes], None]) -> int:
    """Serve ``reads`` of one file with coalesced preads; returns bytes read."""
    reads.sort(key=lambda r: r.offset)
    total = 0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        ctx.sink.add("E410", path.name, None, f"cannot open: {exc.strerror or exc}")
        return 0
    try:
        i = 0
        while i < len(reads):
            start, end, j = reads[i].offset, reads[i].offset + reads[i].length, i + 1
            while (j < len(reads) and reads[j].offset - end <= MERGE_GAP
                   and max(end, reads[j].offset + reads[j].length) - start <= MERGE_MAX):
                end = max(end, reads[j].offset + reads[j].length)
                j += 1
            try:
                buf = os.pread(fd, end - start, start)
            except OSError as exc:
                ctx.sink.add("E410", path.name, None, f"read of bytes [{start}, {end}) failed: {exc.strerror or exc}")
                buf = b""
            total += len(buf)
            for r in reads[i:j]:
                a = r.offset - start
                chunk = buf[a:a + r.length]
                if len(chunk) == r.length:
                    dispatch(r, chunk)
                else:
                    ctx.sink.add("E410", path.name, None, f"file ends before byte {r.offset + r.length}")
            i = j
    finally:
        os.close(fd)
    return total


# ----------------------------------------------------------------------------- per-tensor checks
class Checks:
    """Checks shared by sampled and deep mode; each takes the raw bytes of (part of) a tensor.

    Sign vectors (two per linear, ~120k on GLM-5) are checked in vectorised batches; only the
    few that fail a batch test go through the per-vector path that words the finding.
    """

    BATCH = 1024

    def __init__(self, ctx: Context, keep: set[str] | None):
        self.ctx = ctx
        self.add = ctx.sink.add
        self.keep = keep                          # linears whose suh/svh are kept (None = all)
        self.vectors: dict[str, np.ndarray] = {}  # prefix.suh / prefix.svh values, for decoding
        self.pending: list[tuple[str, str, bytes]] = []
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.inflight: deque = deque()
        self.blocks: dict[str, list[bytes | None]] = {}
        self.decoded = 0
        self.decode_stats: dict[str, list[float]] = {}

    def dispatch(self, r: _Read, raw: bytes) -> None:
        kind, key = r.kind, r.key
        if kind == "sign":
            prefix, which = key
            if self.keep is None or prefix in self.keep:
                self.vectors[f"{prefix}.{which}"] = np.frombuffer(raw, dtype="<f2")
            self.pending.append((prefix, which, raw))
            if len(self.pending) >= self.BATCH:
                self.flush()
        elif kind == "marker":
            self.marker(key[0], key[1], raw)
        elif kind == "strip":
            self.trellis_strip(key, raw)
        elif kind == "block":
            prefix, row = key
            self.blocks[prefix][row] = raw
        elif kind == "bias":
            self.bias(key, raw)
        elif kind == "dense":
            self.dense(key[0], key[1], raw, key[2])

    def flush(self) -> None:
        """Batch test: fp16 x is zero or non-finite iff ((x & 0x7FFF) - 1) mod 2^16 >= 0x7BFF.

        Only vectors with such values or with padding go through the per-vector path.
        """
        with self.lock:
            items, self.pending = self.pending, []
        if not items:
            return
        u = np.frombuffer(b"".join(raw for _, _, raw in items), dtype="<u2")
        bad = np.bitwise_and(u, 0x7FFF)
        bad -= 1
        pos = np.flatnonzero(bad >= 0x7BFF)
        flagged: set[int] = set()
        if pos.size:
            lens = np.fromiter((len(raw) // 2 for _, _, raw in items), np.int64, len(items))
            ends = np.cumsum(lens)
            flagged.update(np.unique(np.searchsorted(ends, pos, side="right")).tolist())
        for i, (p, w, raw) in enumerate(items):
            if i in flagged or (w == "svh" and self.real(p)[1] < len(raw) // 2):
                self.sign_vector(p, w, raw)

    def submit(self, fn, *args) -> None:
        """Deep mode: decode on worker threads (numpy releases the GIL); at most 2 per worker queued."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=DECODE_THREADS)
        while len(self.inflight) >= 2 * DECODE_THREADS:
            self.inflight.popleft().result()
        self.inflight.append(self.pool.submit(fn, *args))

    def drain(self) -> None:
        while self.inflight:
            self.inflight.popleft().result()
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def file(self, name: str) -> str | None:
        return self.ctx.file_of(name)

    def real(self, prefix: str) -> tuple[int, int]:
        lin = self.ctx.scan.linears[prefix]
        r = self.ctx.real.get(prefix)
        return (min(r[0], lin.k), min(r[1], lin.n)) if r else (lin.k, lin.n)

    def sign_vector(self, prefix: str, which: str, raw: bytes) -> None:
        name = f"{prefix}.{which}"
        a = np.frombuffer(raw, dtype="<f2")
        fin = np.isfinite(a)
        if not fin.all():
            bad = np.flatnonzero(~fin)
            self.add("E401", self.file(name), name, f"{bad.size} NaN/Inf values (first at index {int(bad[0])})")
            return
        k_real, n_real = self.real(prefix)
        real = k_real if which == "suh" else n_real
        zeros = np.flatnonzero(a[:real] == 0)
        if which == "suh" and zeros.size:
            self.add("E402", self.file(name), name,
                     f"{zeros.size} zeros inside the real {real} inputs (first at {int(zeros[0])}): those rows are dead")
        elif which == "svh" and zeros.size == real and real > 0:
            self.add("E402", self.file(name), name, f"all {real} real output columns are zero: the linear is dead")
        elif which == "svh" and zeros.size:
            self.add("W401", self.file(name), name, f"{zeros.size} of {real} real output columns are zero")
        if which == "svh" and a.size > real:
            pad = np.flatnonzero(a[real:] != 0)
            if pad.size:
                self.add("E403", self.file(name), name,
                         f"{pad.size} non-zero values on padding columns [{real}, {a.size}) (must be exactly 0)")

    def bias(self, name: str, raw: bytes) -> None:
        a = np.frombuffer(raw, dtype="<f2")
        if not np.isfinite(a).all():
            self.add("E401", self.file(name), name, f"{int((~np.isfinite(a)).sum())} NaN/Inf values")

    def marker(self, name: str, which: str, raw: bytes) -> None:
        v = int.from_bytes(raw, "little")
        if v != MARKERS[which]:
            self.add("E212", self.file(name), name,
                     f"{which} marker is 0x{v:08X} (int32 {v - (1 << 32) if v >= 1 << 31 else v}), "
                     f"must be 0x{MARKERS[which]:08X}")

    def dense(self, name: str, dtype: str, raw: bytes, whole: bool) -> None:
        if dtype not in ("F16", "BF16", "F32", "F64"):
            return
        a = to_numpy(raw[: len(raw) - len(raw) % DTYPES[dtype][0]], dtype, (-1,))
        fin = np.isfinite(a)
        if not fin.all():
            n_bad = int(a.size - np.count_nonzero(fin))
            first = int(np.flatnonzero(~fin)[0])
            scope = "" if whole else " in the sampled window"
            self.add("E404", self.file(name), name, f"{n_bad} NaN/Inf values{scope} (first at flat index {first})")
        elif whole and name.endswith(NORM_SUFFIXES) and a.size and not a.any():
            self.add("W403", self.file(name), name, "all zeros: every activation through this norm is zeroed")

    def trellis_strip(self, prefix: str, raw: bytes) -> None:
        if not raw.strip(b"\0"):  # all-zero: ~impossible in a real quant (C-speed test)
            name = f"{prefix}.trellis"
            self.add("E409", self.file(name), name,
                     f"sampled {len(raw)} trellis bytes are all zero (data never written: sparse or preallocated file?)")

    def decoded_block(self, prefix: str, w: np.ndarray) -> None:
        """Checks on a decoded piece of W (float32): max/min propagate NaN and Inf, so two passes suffice."""
        name = f"{prefix}.trellis"
        if not w.size:
            return
        hi, lo = float(w.max()), float(w.min())
        if not (np.isfinite(hi) and np.isfinite(lo)):
            self.add("E405", self.file(name), prefix, "decoded weights contain NaN/Inf")
            return
        m = max(hi, -lo)
        if m >= FP16_MAX:
            self.add("E406", self.file(name), prefix, f"decoded |W| reaches {m:.4g}, overflowing fp16")
        flat = w.reshape(-1)
        sq = float(np.dot(flat, flat))  # BLAS, float32 accumulation: plenty for an rms > 100 test
        with self.lock:
            st = self.decode_stats.setdefault(prefix, [0.0, 0.0, 0.0])
            st[0] += sq
            st[1] += w.size
            st[2] = max(st[2], m)

    def finish_decode(self) -> None:
        for prefix, (sq, n, _m) in self.decode_stats.items():
            rms = (sq / n) ** 0.5 if n else 0.0
            if rms > 100:
                self.add("W402", self.file(f"{prefix}.trellis"), prefix, f"decoded weight rms {rms:.4g} (> 100)")


def _h(name: str, salt: int = 0) -> int:
    return zlib.crc32(name.encode(), salt)


def sample_block(ctx: Context, prefix: str) -> tuple[int, int]:
    """The (row block, column block) of 128x128 that sampled mode reads for a linear."""
    lin = ctx.scan.linears[prefix]
    r = ctx.real.get(prefix)
    k_real, n_real = (min(r[0], lin.k), min(r[1], lin.n)) if r else (lin.k, lin.n)
    kb = max(1, -(-k_real // 128))
    nb = max(1, -(-n_real // 128))
    return _h(prefix) % kb, _h(prefix, 1) % nb


def strip_span(ctx: Context, prefix: str) -> tuple[int, int]:
    """The zero-check strip of a trellis: its last 8 tiles (up to 16 KiB).

    It ends where the next tensor (in exllamav3's order, the next linear's suh/svh/marker) begins,
    so it is read by the same pread as those: one read per linear. Trellis ends are spread through
    the whole file, so a region never written (zeros) longer than one linear is caught.
    """
    info = ctx.ckpt.tensors[f"{prefix}.trellis"].info
    n = min(info.nbytes, 8 * info.shape[-1] * 2)
    return info.end - n, n


def sample_spans(ctx: Context, prefix: str) -> list[tuple[int, int]]:
    """Absolute (offset, length) of the trellis bytes of the sampled 128x128 block, one run per tile row."""
    lin = ctx.scan.linears[prefix]
    info = ctx.ckpt.tensors[f"{prefix}.trellis"].info
    bi, bj = sample_block(ctx, prefix)
    kt, nt, width = info.shape
    tile = width * 2
    cols = min(8, nt - 8 * bj)
    return [(info.begin + ((8 * bi + r) * nt + 8 * bj) * tile, cols * tile) for r in range(min(8, kt - 8 * bi))
            if lin.k]


def _decode_plan(ctx: Context, budget: int) -> list[str]:
    """Which linears get a decoded sample block: all when few; else every kind first, then spread."""
    ok = [p for p in ctx.scan.linears if p not in ctx.broken]
    if len(ok) <= budget:
        return ok
    non_expert = [p for p in ok if ctx.scan.linears[p].expert is None]
    experts = [p for p in ok if ctx.scan.linears[p].expert is not None]
    pick: list[str] = []
    for group in (non_expert, experts):
        room = budget - len(pick)
        if room <= 0:
            break
        if len(group) <= room:
            pick.extend(group)
        else:
            step = len(group) / room
            pick.extend(group[int(i * step)] for i in range(room))
    return pick


def _codebook(lin) -> str:
    return lin.codebook if lin.codebook in ("mcg", "mul1") else "3inst"


def _decode_blocks(checks: Checks, items: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """items: (prefix, trellis block [8, 8, width], its 128 suh, its 128 svh), decoded together per
    (width, codebook), at most 64 blocks per BLAS call."""

    ctx = checks.ctx
    groups: dict[tuple[int, str], list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]] = defaultdict(list)
    for item in items:
        groups[(item[1].shape[-1], _codebook(ctx.scan.linears[item[0]]))].append(item)
    for (_width, cb), lst in groups.items():
        for a in range(0, len(lst), 64):
            part = lst[a:a + 64]
            what = decode_rotated(np.concatenate([x[1] for x in part], axis=0), cb)  # (128*m, 128)
            # all blocks at once: rows then columns, each ONE BLAS call over the stacked blocks
            w = had_rows(what.astype(np.float32)) * np.concatenate([x[2] for x in part]).astype(np.float32)[:, None]
            w = had_cols(w).reshape(len(part), 128, 128) * np.stack([x[3] for x in part]).astype(np.float32)[:, None, :]
            for idx, x in enumerate(part):
                checks.decoded_block(x[0], w[idx])
                checks.decoded += 1


def _small_reads(ctx: Context, linears=None, dense=None) -> dict[Path, list[_Read]]:
    """Reads for sign vectors, markers, biases and dense tensors (windows of large ones).

    ``linears``/``dense``: plan these only (a worker plans its own file); default all.
    """
    T = ctx.ckpt.tensors
    reads: dict[Path, list[_Read]] = defaultdict(list)

    def want(name: str, kind: str, key: Any, window: int | None = None) -> None:
        ref = T[name]
        i = ref.info
        n = i.nbytes if window is None else min(window, i.nbytes)
        off = i.begin
        if n < i.nbytes:  # sampled window at a name-dependent, item-aligned offset
            slots = (i.nbytes - n) // i.itemsize
            off += (_h(name) % (slots + 1)) * i.itemsize
        if n:
            reads[ref.file].append(_Read(off, n, kind, key))

    for p in ctx.scan.linears if linears is None else linears:
        for s in ("suh", "svh"):
            name = f"{p}.{s}"
            if name in T:
                if p not in ctx.broken:
                    want(name, "sign", (p, s))
                elif T[name].info.dtype == "F16":
                    want(name, "bias", name)  # finiteness still meaningful
        b = f"{p}.bias"
        if b in T and T[b].info.dtype == "F16":
            want(b, "bias", b)
        for m in ("mcg", "mul1"):
            ref = T.get(f"{p}.{m}")
            if ref is not None and ref.info.dtype == "I32" and ref.info.shape == ():
                want(f"{p}.{m}", "marker", (f"{p}.{m}", m))
    for name in ctx.scan.dense if dense is None else dense:
        dtype = ctx.scan.dense[name][0]
        if dtype in ("F16", "BF16", "F32", "F64") and not name.endswith((".suh", ".svh", ".su", ".sv")):
            whole = T[name].info.nbytes <= DENSE_SAMPLE
            want(name, "dense", (name, dtype, whole), None if whole else DENSE_SAMPLE)
    return reads


def _file(T, prefix: str) -> Path | None:
    for s in ("trellis", "suh", "svh"):
        ref = T.get(f"{prefix}.{s}")
        if ref is not None:
            return ref.file
    return None


def can_fork() -> bool:
    return (os.cpu_count() or 1) > 1 and "fork" in multiprocessing.get_all_start_methods()


def check_sampled(ctx: Context, sample_blocks: int, meanwhile: Callable[[], None] | None = None) -> dict[str, Any]:
    """Sampled numeric checks, one job per file (plus the deferred quantization_config.json job).

    Python-level work per tensor dominates on 200k-tensor checkpoints, so with more than one core
    the jobs run in forked processes (each owns whole files: the sign vectors, strip and decoded
    block of a linear all live in its file); ``meanwhile`` runs here in parallel.
    """
    return finish_sampled(start_sampled(ctx), sample_blocks, meanwhile)


@dataclass
class SampledRun:
    ctx: Context
    pool: ProcessPoolExecutor | None
    qfile: Any  # the quantization_config.json job's Future (pool) or None (run in finish_sampled)


def start_sampled(ctx: Context) -> SampledRun:
    """Fork the workers now and start the deferred quantization_config.json job in one of them: it
    needs the scan but not check_linears, so it overlaps the checks this process still runs. File jobs
    are sent later with what those checks found (``ctx.broken``) as arguments."""
    global _STATE
    _STATE = (ctx, check_qfile)
    workers = min(os.cpu_count() or 1, len(ctx.ckpt.headers) + 1, MAX_PROCS)
    if workers > 1 and can_fork() and len(ctx.ckpt.tensors) >= FORK_MIN_TENSORS:
        gc.freeze()  # keep the collector from touching (and so copying) the parent's heap in workers
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        return SampledRun(ctx, pool, pool.submit(_job, ("qfile",)))
    return SampledRun(ctx, None, None)


def abort_sampled(run: SampledRun) -> None:
    """Undo start_sampled when a check between it and finish_sampled raised."""
    global _STATE
    if run.pool is not None:
        run.pool.shutdown(cancel_futures=True)
    _STATE = None
    gc.unfreeze()


def finish_sampled(run: SampledRun, sample_blocks: int, meanwhile: Callable[[], None] | None = None) -> dict[str, Any]:
    ctx, pool = run.ctx, run.pool
    plan = set(_decode_plan(ctx, max(0, sample_blocks)))
    T = ctx.ckpt.tensors
    by_file: dict[Path, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for p in ctx.scan.linears:
        f = _file(T, p)
        if f is not None:
            by_file[f][0].append(p)
    for name in ctx.scan.dense:
        by_file[T[name].file][1].append(name)
    broken = set(ctx.broken)
    jobs: list[Any] = [("file", f, *by_file[f], broken, plan) for f in sorted(by_file)]
    try:
        if pool is not None:
            with pool:
                futs = [run.qfile] + [pool.submit(_job, j) for j in jobs]
                if meanwhile:
                    meanwhile()
                results = [f.result() for f in futs]
        else:
            if meanwhile:
                meanwhile()
            results = [_job(j) for j in [("qfile",), *jobs]]
    finally:
        global _STATE
        _STATE = None
        gc.unfreeze()
    nbytes = 0
    items: list = []
    for findings, nb, its in results:
        nbytes += nb
        items.extend(its)
        for f in findings:
            ctx.sink.add(f.code, f.file, f.tensor, f.message)
    # Decoding happens here, once for all files: BLAS in forked workers spins its threads after every
    # small GEMM and, on few cores, doubled the workers' CPU time (GLM-5: 5.1 -> 2.9 s).
    checks = Checks(ctx, set())
    _decode_blocks(checks, items)
    checks.finish_decode()
    return {"bytes_read": nbytes, "decoded_blocks": checks.decoded}


_STATE: tuple | None = None  # (ctx, check_qfile) for _job, inherited by forked workers


def _job(job: tuple) -> tuple[list, int, list]:
    """("qfile",) or ("file", path, linears, dense names, broken linears, decode plan)."""
    ctx, check_qfile = _STATE
    sink = ctx.sink
    start = len(sink.findings)
    if job[0] == "qfile":
        check_qfile(ctx)
        out: tuple[int, list] = (0, [])
    else:
        _, path, linears, dense, broken, plan = job
        ctx.broken.update(broken)  # a worker forked before check_linears filled it
        out = _sampled_file(path, linears, dense, plan)
    with sink._lock:
        new = list(sink.findings[start:])
    return new, *out


def _sampled_file(path: Path, linears: list[str], dense: list[str], plan: set[str]) -> tuple[int, list]:
    """All sampled checks of one file but the decode; returns (bytes read, _decode_blocks items)."""
    ctx = _STATE[0]
    T = ctx.ckpt.tensors
    checks = Checks(ctx, plan)
    planned = _small_reads(ctx, linears, dense)  # a linear's parts in other files are read here too
    reads = planned[path]
    for p in linears:
        ref = T[f"{p}.trellis"]
        if p in ctx.broken or ref.file != path:
            continue
        off, n = strip_span(ctx, p)
        if n:
            reads.append(_Read(off, n, "strip", p))
        spans = sample_spans(ctx, p) if p in plan else []
        if spans:
            checks.blocks[p] = [None] * len(spans)
            reads.extend(_Read(off, n, "block", (p, r)) for r, (off, n) in enumerate(spans))
    nbytes = sum(_read_all(f, rs, ctx, checks.dispatch) for f, rs in planned.items())
    checks.flush()
    items = []
    for p, rows in checks.blocks.items():
        if any(r is None for r in rows):
            continue
        width = T[f"{p}.trellis"].info.shape[-1]
        tiles = np.frombuffer(b"".join(rows), dtype="<i2").reshape(len(rows), -1, width)
        if tiles.shape[0] == 8 and tiles.shape[1] == 8:
            su, sv = checks.vectors.get(f"{p}.suh"), checks.vectors.get(f"{p}.svh")
            if su is not None and sv is not None:
                bi, bj = sample_block(ctx, p)
                items.append((p, tiles, su[128 * bi:128 * bi + 128].copy(), sv[128 * bj:128 * bj + 128].copy()))
    return nbytes, items
