"""Stream a RankPlan to disk: each source shard is read once, sequentially, in bounded chunks, and
every rank file is written sequentially while it is hashed, so nothing is read back and peak memory
stays at a few chunks. A journal of finished files makes --resume safe; manifest.json is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from exl3tools import __version__
from exl3tools.checkpoint import jsonio
from exl3tools.checkpoint.copy import copy_tensor
from exl3tools.checkpoint.jsonio import open_regular
from exl3tools.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    RankEntry,
    RankManifest,
    load_manifest,
    sha256_file,
)
from exl3tools.checkpoint.reader import INDEX_NAME, TOKENIZER_FILES, Checkpoint
from exl3tools.checkpoint.writer import (
    AsyncShardWriter,
    ByteBudget,
    NullWriter,
    fsync_dir,
    index_json,
    json_bytes,
    refuse_overlap,
    write_atomic,
    write_atomic_text,
)
from exl3tools.errors import CheckpointError, IncompleteOutputError, OutputExistsError, UsageError
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

    def entries(self) -> list[dict[str, Any]]:
        """The journal's records (a torn last line from a crash, or any line that is no record, skipped)."""
        if jsonio.path_kind(self.path) is None:
            return []
        out = []
        for line in jsonio.read_regular(self.path, "rank-slice journal", jsonio.MAX_JSON_BYTES).splitlines():
            try:
                e = jsonio.loads_bounded(line, "journal line", 4, ValueError)
            except ValueError:
                continue
            if isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("size"), int):
                out.append(e)
        return out

    def load(self, expected: set[str], previous: dict[str, FileEntry] | None = None) -> None:
        """Trust journal lines (and a previous complete manifest of the same plan) whose file still
        has the recorded size and sha256."""
        entries = [{"path": k, "size": v.size, "sha256": v.sha256, "plan": self.plan_fp}
                   for k, v in (previous or {}).items()]
        for e in entries + self.entries():
            if e.get("plan") != self.plan_fp or e["path"] not in expected or e["path"] in self.done:
                continue
            p = self.path.parent / e["path"]
            if p.is_file() and p.stat().st_size == e["size"] and sha256_file(p) == e.get("sha256"):
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


def _write_one_shard(ck: Checkpoint, plan: RankPlan, si: int, dst: Path, journal: _Journal,
                     progress: Callable[[int], None], dequant: Callable | None, budget: ByteBudget,
                     selected: frozenset[int]) -> None:
    sp = plan.shards[si]
    rels = [f"{d}/{sp.out_name}" if d != "." else sp.out_name for d in plan.dirs]
    if all(rels[i] in journal.done for i in selected):
        progress(sum(t.nbytes for i in selected for t in sp.outputs[i]))
        return
    hd = ck.headers[sp.source_file]
    by_src: dict[str, list[tuple[int, OutTensor]]] = {}   # source tensor -> its targets
    for i, outs in enumerate(sp.outputs):
        for t in outs:
            by_src.setdefault(t.src, []).append((i, t))
    src = ck.root / sp.source_file
    fd = open_regular(src, "safetensors shard")
    writers: list[Any] = []
    ahead = 0  # the kernel reads [.., ahead) in the background while we slice and hash
    try:
        try:
            size = os.fstat(fd).st_size
            if size != hd.file_size:  # changed since its header was read: the plan no longer holds
                raise CheckpointError(f"{src}: {size} bytes now, {hd.file_size} when it was opened "
                                      f"({'truncated' if size < hd.file_size else 'rewritten'} meanwhile)")
            for i, outs in enumerate(sp.outputs):
                writers.append(NullWriter() if rels[i] in journal.done or i not in selected else
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
                if all(i not in selected for i, _ in group):  # only ranks not asked for (--ranks)
                    for i, _ in group:
                        cursors[i] += 1
                    continue
                copy_tensor(fd, info.begin, info.shape, info.itemsize,
                            [(writers[i], t) for i, t in group if i in selected],
                            progress, path=src, ranges=True)
                for i, _ in group:
                    cursors[i] += 1
            done = [(rels[i], w.close()) for i, w in enumerate(writers) if not isinstance(w, NullWriter)]
        except BaseException:
            for w in writers:
                w.abort()
            raise
    finally:
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


def check_destination(dst: Path, resume: bool, src: Path | None = None) -> None:
    """DST must not overlap SRC, and must be empty or absent unless --resume."""
    if src is not None:
        refuse_overlap(src, dst)
    if dst.exists() and not dst.is_dir():
        raise OutputExistsError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not resume:
        what = "a complete sliced output" if (dst / MANIFEST_NAME).exists() else "a non-empty directory"
        raise OutputExistsError(f"{dst}: {what} is already there (use --resume, or another DST)")


def _small_names(plan: RankPlan) -> set[str]:
    """The names this plan writes in each output dir."""
    return {s.out_name for s in plan.shards} | {INDEX_NAME, "config.json", "quantization_config.json",
                                                 *TOKENIZER_FILES}


def _check_resumable(dst: Path, plan: RankPlan, journal: _Journal) -> dict[str, FileEntry] | None:
    """--resume continues this plan only. Anything in DST it would not write (the rank dirs of another
    --tp, a journal or manifest of another plan) would end up under a manifest that does not describe
    it, so it is refused. Returns the files of a complete manifest of this same plan, if there is one."""
    names = _small_names(plan)
    allowed = {MANIFEST_NAME, JOURNAL} | (names if "." in plan.dirs else set(plan.dirs))
    foreign = [p.name for p in dst.iterdir() if p.name not in allowed and not _is_tmp(p.name)]
    for d in plan.dirs:
        if d != "." and (dst / d).is_dir():
            foreign += [f"{d}/{p.name}" for p in (dst / d).iterdir() if p.name not in names and not _is_tmp(p.name)]
    if foreign:
        raise OutputExistsError(f"{dst}: --resume would keep {', '.join(sorted(foreign)[:3])}"
                                f"{' ...' if len(foreign) > 3 else ''}, which this plan (tp {plan.tp}, moe {plan.moe}, "
                                f"layout {plan.layout}) does not write: an output of another plan? Use another DST")
    others = {e.get("plan") for e in journal.entries()} - {plan.fingerprint, None}
    previous = None
    if jsonio.path_kind(dst / MANIFEST_NAME) is not None:
        try:
            old = load_manifest(dst)
        except IncompleteOutputError:  # a broken manifest is not trusted; the journal decides
            old = None
        if old is not None:
            if old.plan_fingerprint != plan.fingerprint:
                others.add(old.plan_fingerprint)
            else:
                previous = old.files
    if others:
        raise OutputExistsError(f"{dst}: --resume of a different plan (DST was written for "
                                f"{sorted(str(o) for o in others)[0][:19]}..., this plan is {plan.fingerprint[:19]}...; "
                                "another --tp, --moe, --layout or source): use another DST")
    return previous


def _is_tmp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def write_rank_shards(ck: Checkpoint, plan: RankPlan, dst: str | os.PathLike[str], *, resume: bool = False,
                      threads: int | None = None, progress: Callable[[int], None] | None = None,
                      dequant: Callable | None = None, ranks: Iterable[int] | None = None) -> RankManifest:
    """Write every output of ``plan`` under ``dst`` (or only the output dirs ``ranks``); manifest.json
    last, listing only what was written. Returns the manifest."""
    dst = Path(dst)
    selected = frozenset(range(len(plan.dirs)) if ranks is None else ranks)
    if not selected or not selected <= set(range(len(plan.dirs))):
        raise UsageError(f"--ranks must name ranks 0..{len(plan.dirs) - 1}, got {sorted(selected)}")
    check_destination(dst, resume, ck.root)
    dst.mkdir(parents=True, exist_ok=True)
    journal = _Journal(dst, plan.fingerprint)
    previous = _check_resumable(dst, plan, journal) if resume else None
    (dst / MANIFEST_NAME).unlink(missing_ok=True)  # a resumed run is incomplete until it ends
    for i, d in enumerate(plan.dirs):
        if i in selected:
            (dst / d).mkdir(parents=True, exist_ok=True)
    if resume:
        expected = {f"{d}/{n}" if d != "." else n for i, d in enumerate(plan.dirs) if i in selected
                    for n in _small_names(plan)}
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
            _write_one_shard(ck, plan, si, dst, journal, prog, dequant, budget, selected)
    else:
        with ThreadPoolExecutor(nthreads) as pool:
            futs = [pool.submit(_write_one_shard, ck, plan, si, dst, journal, prog, dequant, budget, selected)
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
        if i not in selected:
            continue
        base = dst / d
        wm = {t.name: s.out_name for s in plan.shards for t in s.outputs[i]}
        total = sum(t.nbytes for s in plan.shards for t in s.outputs[i])
        small: dict[str, bytes] = {INDEX_NAME: index_json(wm, total), "config.json": json_bytes(plan.configs[i])}
        if ck.quantization_config_file is not None and plan.layout == "ranks":
            small["quantization_config.json"] = json_bytes(
                {k: v for k, v in ck.quantization_config_file.items() if k != "tensor_storage"})
        for tf in TOKENIZER_FILES:
            if (ck.root / tf).is_file():
                small[tf] = jsonio.read_regular(ck.root / tf, tf, jsonio.MAX_TEXT_BYTES)
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
