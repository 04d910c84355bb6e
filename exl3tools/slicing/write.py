"""Stream a RankPlan to disk: each source shard is read once, sequentially, in bounded chunks, and
every rank file is written sequentially while it is hashed, so nothing is read back and peak memory
stays at a few chunks. A journal of finished files makes --resume safe; manifest.json is written last.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import signal
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from exl3tools import __version__
from exl3tools.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    RankEntry,
    RankManifest,
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
from exl3tools.errors import OutputExistsError
from exl3tools.slicing.plan import OutTensor, RankPlan

JOURNAL = ".rank-slice.journal"
CHUNK_BYTES = 32 << 20          # bound on one read; peak RSS ~ a few of these + the write budget
PREFETCH_BYTES = 128 << 20      # read-ahead window per source shard (page cache, not RSS)
KILL_ENV = "EXL3TOOLS_TEST_KILL_AFTER_FILES"  # crash tests: SIGKILL self after N finished files


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
