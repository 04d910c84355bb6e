"""rank-slice straight from a Hugging Face repo: fetch only the byte ranges the selected ranks need.

Flow (docs/rank-slice.md, "From the Hub"):

    open_remote(spec)        model_info -> commit sha; small files through hf_hub_download (the hub
                             cache); per shard a HEAD (size, etag) and its header by range request,
                             written into a sparse *range mirror* of the repo
    plan_rank_slices(ck)     the same plan as the local path: the mirror's headers are the real ones
    fetch_ranges(src, need)  exactly the source byte ranges of the selected ranks, in parallel, through
                             huggingface_hub's HTTP client (get_session, build_hf_headers, hf_hub_url:
                             its token, HF_ENDPOINT and redirects), each range streamed into the
                             mirror as it arrives; a dropped connection resumes at the next byte
    write_rank_shards(...)   the local writer, reading the mirror: same bytes, same atomic,
                             manifest-last output

The mirror lives under ``$HF_HOME/exl3tools/ranges/models--ORG--NAME/COMMIT/``: each shard is a sparse
file of the source's size, and ``.NAME.ranges`` records the byte ranges that arrived whole (with the
file's etag and size), so a rerun fetches only what is missing. Every response is checked: a 206 for
exactly the asked range of a file of the planned size, X-Repo-Commit equal to the planned commit and
the hub's etag (the LFS sha256) equal to the one seen at planning; anything else is refused
(RevisionChangedError) rather than mixed into the output.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from exl3tools.checkpoint.header import TensorInfo
from exl3tools.checkpoint.reader import INDEX_NAME, Checkpoint
from exl3tools.checkpoint.writer import write_atomic
from exl3tools.errors import CheckpointError, NotFoundError, RevisionChangedError, TransferError, UsageError
from exl3tools.hub import SMALL_FILES, split_revision, transport_errors
from exl3tools.text import printable

PIECE = 64 << 20             # longer ranges are fetched as several requests, in parallel
PARALLEL = 8                 # concurrent range requests
EXTRA_BYTES = 1 << 20        # bytes past a range read (to keep its connection) before it is cut off
SYNC_BYTES = 64 << 20        # fsync the mirror and log its complete ranges every this many bytes
RETRIES = 5                  # consecutive failures without progress before giving up
MAX_HEADER = 100 << 20       # a safetensors header longer than this is hostile
RETRY_STATUS = (429, 500, 502, 503, 504)
Range = tuple[int, int]      # [start, end) in bytes of one source file


@dataclass(frozen=True, slots=True)
class RemoteFile:
    name: str
    size: int
    etag: str | None


@dataclass(frozen=True, slots=True)
class RemoteSource:
    repo: str
    revision: str | None     # as asked (None = the default branch)
    commit: str              # what it resolved to at planning
    mirror: Path
    files: tuple[RemoteFile, ...]

    @property
    def spec(self) -> str:
        return f"hf://{self.repo}@{self.commit}"

    def file(self, name: str) -> RemoteFile:
        return next(f for f in self.files if f.name == name)


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "exl3tools" / "ranges"


# ---------------------------------------------------------------------------- which bytes
def tensor_ranges(info: TensorInfo, dim: int | None, a: int | None, b: int | None) -> Iterator[Range]:
    """The source byte ranges of ``info[..., a:b, ...]`` (along ``dim``), in file order."""
    if dim is None:
        yield info.begin, info.end
        return
    inner = math.prod(info.shape[dim + 1:]) * info.itemsize
    row = info.shape[dim] * inner
    for o in range(math.prod(info.shape[:dim])):
        base = info.begin + o * row
        yield base + a * inner, base + b * inner


def merge(ranges: Iterable[Range], gap: int = 0) -> list[Range]:
    """Sorted union; ranges closer than ``gap`` bytes become one (fewer requests, a few more bytes)."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(ranges: Iterable[Range], done: list[Range]) -> list[Range]:
    """The parts of ``ranges`` outside ``done`` (sorted, disjoint), in order: one sweep over both."""
    out: list[Range] = []
    j = 0
    for a, b in sorted(ranges):
        while j < len(done) and done[j][1] <= a:
            j += 1
        k = j
        while a < b and k < len(done) and done[k][0] < b:
            da, db = done[k]
            if da > a:
                out.append((a, da))
            a = max(a, db)
            k += 1
        if a < b:
            out.append((a, b))
    return out


def needed_ranges(ck: Checkpoint, outputs: Iterable[tuple[str, tuple]], gap: int = 0) -> dict[str, list[Range]]:
    """source file -> merged byte ranges, for (source file, (src tensor, dim, start, stop)) pairs."""
    per_file: dict[str, list[Range]] = {}
    for fname, (src, dim, a, b) in outputs:
        per_file.setdefault(fname, []).extend(tensor_ranges(ck.headers[fname].tensors[src], dim, a, b))
    return {f: merge(r, gap) for f, r in sorted(per_file.items())}


def plan_outputs(plan: Any, ranks: Iterable[int]) -> Iterator[tuple[str, tuple]]:
    for sp in plan.shards:
        for r in ranks:
            for t in sp.outputs[r]:
                yield sp.source_file, (t.src, t.dim, t.start, t.stop)


def fetch_summary(plan: Any, ck: Checkpoint, ranks: list[int], gap: int = 0) -> dict[str, Any]:
    """What --dry-run prints: per rank its exact bytes and ranges, and the union for this node."""
    per_rank = []
    for r in ranks:
        need = needed_ranges(ck, plan_outputs(plan, [r]), gap)
        per_rank.append({"rank": r, "dir": plan.dirs[r], "bytes": sum(b - a for v in need.values() for a, b in v),
                         "ranges": sum(len(v) for v in need.values()),
                         "tensor_bytes": sum(t.nbytes for sp in plan.shards for t in sp.outputs[r])})
    union = needed_ranges(ck, plan_outputs(plan, ranks), gap)
    total = sum(ck.headers[f].file_size for f in ck.headers)
    fetch = sum(b - a for v in union.values() for a, b in v)
    return {"ranks": per_rank, "fetch_bytes": fetch, "fetch_ranges": sum(len(v) for v in union.values()),
            "repo_bytes": total, "fraction": fetch / total if total else 0.0}


# ---------------------------------------------------------------------------- the Hub
def _hub_call(what: str, fn: Callable, *args, **kw):
    """Call huggingface_hub; its errors become one-line exl3tools errors naming ``what``."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return fn(*args, **kw)
    except RepositoryNotFoundError:
        raise NotFoundError(f"{what}: no such Hugging Face repository (or no access)") from None
    except RevisionNotFoundError:
        raise NotFoundError(f"{what}: no such revision") from None
    except EntryNotFoundError:
        raise NotFoundError(f"{what}: not in the repository") from None
    except HfHubHTTPError as exc:
        code = getattr(getattr(exc, "response", None), "status_code", "?")
        raise TransferError(f"{what}: the Hub at {constants.ENDPOINT} answered HTTP {code}") from None
    except transport_errors() as exc:
        raise TransferError(f"{what}: cannot reach the Hub at {constants.ENDPOINT} ({type(exc).__name__})") from None


def _etag(v: str | None) -> str | None:
    if not v:
        return None
    v = v.strip()
    return v[2:].strip('"') if v.startswith("W/") else v.strip('"')


def open_remote(spec: str, mirror: Path | None = None) -> tuple[Checkpoint, RemoteSource]:
    """Resolve REPO[@REV] to a commit, build its range mirror (small files + headers), open it."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url

    repo, rev = split_revision(spec.removeprefix("hf://"))
    info = _hub_call(spec, HfApi().model_info, repo, revision=rev)
    commit = info.sha
    if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise TransferError(f"{spec}: the Hub gave no commit sha for this revision")
    names = {s.rfilename for s in info.siblings or ()}
    if "config.json" not in names:
        raise NotFoundError(f"{spec}: no config.json in the repository")
    mirror = mirror or cache_root() / f"models--{repo.replace('/', '--')}" / commit
    mirror.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        if name in names:
            local = _hub_call(f"hf://{repo}/{name}", hf_hub_download, repo, name, revision=commit)
            data = Path(local).read_bytes()
            if not (mirror / name).is_file() or (mirror / name).read_bytes() != data:
                write_atomic(mirror / name, data)
    if INDEX_NAME in names:
        try:
            idx = json.loads((mirror / INDEX_NAME).read_bytes())
        except ValueError:
            idx = None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"hf://{repo}/{INDEX_NAME}: no weight_map object")
        shards = sorted({str(v) for v in wm.values()})
    else:
        shards = sorted(n for n in names if n.endswith(".safetensors") and "/" not in n)
    # names come from the server: a shard is written as mirror/NAME, so no folders, no "..", and it
    # must be a file the repository lists
    bad = [n for n in shards if "/" in n or "\\" in n or n.startswith(".") or not n.endswith(".safetensors")
           or n not in names]
    if bad:
        raise CheckpointError(f"hf://{repo}: shard name {bad[0]!r} is not a top-level .safetensors file of the repo")
    if not shards:
        raise NotFoundError(f"{spec}: no safetensors files in the repository")
    files = []
    for name in shards:
        meta = _hub_call(f"hf://{repo}/{name}", get_hf_file_metadata, hf_hub_url(repo, name, revision=commit))
        if meta.commit_hash and meta.commit_hash != commit:
            raise RevisionChangedError(f"hf://{repo}: revision {rev or 'main'} moved from {commit[:12]} to "
                                       f"{meta.commit_hash[:12]} while it was being read; run again")
        if meta.size is None:
            raise TransferError(f"hf://{repo}/{name}: the Hub gave no size for this file")
        files.append(RemoteFile(name, meta.size, _etag(meta.etag)))
    src = RemoteSource(repo, rev, commit, mirror, tuple(files))
    for rf in files:  # headers: 8 bytes of length, then the JSON, into the mirror
        m = _Mirror(src, rf)
        try:
            m.fetch([(0, min(8, rf.size))])
            n = int.from_bytes(os.pread(m.fd, 8, 0).ljust(8, b"\0"), "little")
            if n > MAX_HEADER or 8 + n > rf.size:
                raise CheckpointError(f"hf://{repo}/{rf.name}: header length {n} does not fit a "
                                      f"{rf.size}-byte file")
            m.fetch([(8, 8 + n)])
        finally:
            m.close()
    return Checkpoint.open(mirror), src


# ---------------------------------------------------------------------------- fetching
class _Mirror:
    """One sparse mirror file and its record of complete ranges."""

    def __init__(self, src: RemoteSource, rf: RemoteFile):
        self.src, self.rf = src, rf
        self.path = src.mirror / rf.name
        self.log = src.mirror / f".{rf.name}.ranges"
        self.lock, self.log_lock = threading.Lock(), threading.Lock()
        self.pending: list[Range] = []
        self.unsynced = 0
        self.done = self._load()       # sorted, disjoint; ranges completed since are in self.new
        self.new: list[Range] = []
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size != rf.size:
            os.ftruncate(self.fd, rf.size)

    def _load(self) -> list[Range]:
        """Ranges recorded for this very file (same size and etag); anything else is forgotten."""
        out: list[Range] = []
        try:
            lines = self.log.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                e = json.loads(line)
                if e["size"] == self.rf.size and e["etag"] == self.rf.etag and e["commit"] == self.src.commit:
                    out.append((int(e["a"]), int(e["b"])))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line after a crash
        if not out:
            self.log.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)  # a mirror of another version of the file: start over
        return merge(out)

    def missing(self, ranges: list[Range]) -> list[Range]:
        """The parts of ``ranges`` not yet complete: one sweep over both sorted lists (a column cut
        of a GLM-5-size rank is ~10^6 ranges, so no range may rescan the completed ones)."""
        with self.lock:
            if self.new:
                self.done, self.new = merge(self.done + self.new), []
            done = self.done
        return subtract(ranges, done)

    def _record(self, a: int, b: int) -> None:
        """Note [a, b) as complete; the note is made durable (after the data) by ``sync``."""
        with self.lock:
            self.pending.append((a, b))
            self.new.append((a, b))         # merged into done when next asked (missing)
            self.unsynced += b - a
            due = self.unsynced >= SYNC_BYTES
        if due:
            self.sync()

    def sync(self) -> None:
        """fsync the data, then append the ranges it holds to the log (so a logged range is on disk)."""
        with self.lock:
            pending, self.pending, self.unsynced = self.pending, [], 0
        if not pending:
            return
        os.fsync(self.fd)
        lines = "".join(json.dumps({"a": a, "b": b, "size": self.rf.size, "etag": self.rf.etag,
                                    "commit": self.src.commit}) + "\n" for a, b in pending)
        with self.log_lock, open(self.log, "a") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())

    def fetch(self, ranges: list[Range], progress: Callable[[int], None] = lambda n: None,
              stop: threading.Event | None = None, known_missing: bool = False) -> None:
        """Fetch what of ``ranges`` is missing (``known_missing``: all of it, as fetch_ranges's
        pieces are, which skips a merge of the completed ranges per piece)."""
        for a, b in (ranges if known_missing else self.missing(ranges)):
            fetch_range(self.src, self.rf, self.fd, a, b, progress, stop)
            self._record(a, b)

    def close(self) -> None:
        try:
            self.sync()
        finally:
            os.close(self.fd)


def _check_response(src: RemoteSource, rf: RemoteFile, r: Any, a: int, b: int) -> None:
    """The answer must be exactly bytes [a, b) of the planned file at the planned commit."""
    hub = r.history[0].headers if getattr(r, "history", None) else r.headers  # the Hub's own reply
    where = f"hf://{src.repo}/{rf.name}"
    commit = hub.get("X-Repo-Commit")
    if commit and commit != src.commit:
        raise RevisionChangedError(f"hf://{src.repo}: revision {src.revision or 'main'} moved from "
                                   f"{src.commit[:12]} to {commit[:12]} between plan and fetch; run again")
    etag = _etag(hub.get("X-Linked-Etag") or (None if r.history else r.headers.get("ETag")))
    if etag and rf.etag and etag != rf.etag:
        raise RevisionChangedError(f"{where}: etag {etag[:16]}... differs from {rf.etag[:16]}... seen when "
                                   "it was planned (the file changed); run again")
    if r.status_code != 206:
        raise TransferError(f"{where}: asked for bytes {a}-{b - 1}, the server answered HTTP {r.status_code} "
                            "(no range support?)")
    want = f"bytes {a}-{b - 1}/{rf.size}"
    got = (r.headers.get("Content-Range") or "").strip()
    if got != want:
        if got.rpartition("/")[2] != str(rf.size):
            raise RevisionChangedError(f"{where}: the server's file is not {rf.size} bytes any more "
                                       f"(Content-Range {got!r}); run again")
        raise TransferError(f"{where}: asked for {want}, got Content-Range {got!r}")
    length = r.headers.get("Content-Length")
    if length is not None and length.strip() != str(b - a):
        raise TransferError(f"{where}: asked for {b - a} bytes ({want}), the answer says Content-Length "
                            f"{printable(length.strip()[:40])}")


def fetch_range(src: RemoteSource, rf: RemoteFile, fd: int, a: int, b: int,
                progress: Callable[[int], None], stop: threading.Event | None = None) -> None:
    """Bytes [a, b) of ``rf`` into ``fd`` at the same offsets, written as they arrive (the client's
    read size, ~64 KiB, bounds the memory per request). A dropped connection
    or a retryable status resumes at the first byte not yet written."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(src.repo, rf.name, revision=src.commit)
    retryable = (*transport_errors(), _ShortRead)
    pos, failures = a, 0
    while pos < b:
        if stop is not None and stop.is_set():
            raise TransferError(f"hf://{src.repo}/{rf.name}: cancelled")
        start = pos
        headers = build_hf_headers()
        headers.update({"Range": f"bytes={pos}-{b - 1}", "Accept-Encoding": "identity"})
        try:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True) as r:
                try:
                    hf_raise_for_status(r)
                except HfHubHTTPError:
                    if r.status_code in RETRY_STATUS:
                        raise _ShortRead(f"HTTP {r.status_code}") from None
                    raise TransferError(f"hf://{src.repo}/{rf.name}: HTTP {r.status_code} for bytes "
                                        f"{pos}-{b - 1}") from None
                _check_response(src, rf, r, pos, b)
                # as it arrives (a chunk size would hold back a tail); read to the end of the body
                # (Content-Range is checked: nothing past b) since a response left unread closes
                # its connection and every range would pay a new TCP (and TLS) handshake; a server
                # that sends on past b anyway is cut off after EXTRA_BYTES
                extra = 0
                for chunk in r.iter_bytes():
                    take = memoryview(chunk)[: b - pos]
                    if take:
                        os.pwrite(fd, take, pos)
                        pos += len(take)
                        progress(len(take))
                    extra += len(chunk) - len(take)
                    if extra > EXTRA_BYTES:
                        break
            if pos < b:
                raise _ShortRead(f"connection ended at byte {pos} of {a}-{b - 1}")
        except retryable as exc:
            failures = 1 if pos > start else failures + 1
            if failures > RETRIES:
                raise TransferError(f"hf://{src.repo}/{rf.name}: bytes {pos}-{b - 1} failed {RETRIES + 1} times "
                                    f"in a row ({type(exc).__name__}: {str(exc)[:80]})") from None
            time.sleep(min(8.0, 0.05 * 2 ** failures))


class _ShortRead(Exception):
    pass


def _pieces(ranges: list[Range]) -> list[Range]:
    return [(p, min(b, p + PIECE)) for a, b in ranges for p in range(a, b, PIECE)]


def fetch_ranges(src: RemoteSource, need: dict[str, list[Range]], *, parallel: int = PARALLEL,
                 progress: Callable[[int], None] | None = None) -> int:
    """Fetch every range of ``need`` not yet in the mirror; returns the bytes fetched."""
    lock = threading.Lock()
    fetched = [0]

    def prog(n: int) -> None:
        with lock:
            fetched[0] += n
            if progress is not None:
                progress(n)

    mirrors = {f: _Mirror(src, src.file(f)) for f in need}
    stop = threading.Event()
    try:
        jobs = [(m, p) for f, m in mirrors.items() for p in _pieces(m.missing(need[f]))]

        def run(job: tuple[_Mirror, Range]) -> None:
            m, p = job
            m.fetch([p], prog, stop, known_missing=True)

        with ThreadPoolExecutor(max(1, parallel)) as pool:
            futs = [pool.submit(run, j) for j in jobs]
            try:
                for fu in futs:
                    fu.result()
            except BaseException:
                stop.set()
                for fu in futs:
                    fu.cancel()
                raise
    finally:
        for m in mirrors.values():
            m.close()
    return fetched[0]


# ---------------------------------------------------------------------------- the flows
def parse_ranks(text: str | None, tp: int) -> list[int]:
    if not text:
        return list(range(tp))
    try:
        ranks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--ranks {text!r}: expected comma-separated rank numbers like 0,1") from None
    bad = [r for r in ranks if not 0 <= r < tp]
    if not ranks or bad:
        raise UsageError(f"--ranks {text!r}: ranks must be in 0..{tp - 1}")
    return ranks


def remote_plan(spec: str, tp: int, moe: str) -> tuple[Checkpoint, RemoteSource, Any]:
    """Plan from the repo's headers; the plan's source names the repo and commit."""
    from exl3tools.slicing import plan_rank_slices

    ck, src = open_remote(spec)
    plan = plan_rank_slices(ck, tp, moe, "ranks")
    return ck, src, replace(plan, source=replace(plan.source, path=src.spec, repo=src.repo, revision=src.commit))


def rank_slice_remote(ck: Checkpoint, src: RemoteSource, plan: Any, dst: Path, ranks: list[int], *,
                      resume: bool = False, gap: int = 0, parallel: int = PARALLEL, keep_cache: bool = False,
                      fetch_progress: Callable[[int], None] | None = None,
                      write_progress: Callable[[int], None] | None = None):
    """Fetch the ranges of ``ranks`` into the mirror, then write them like the local path."""
    from exl3tools.slicing import check_destination

    check_destination(dst, resume, ck.root)
    fetch_ranges(src, needed_ranges(ck, plan_outputs(plan, ranks), gap), parallel=parallel,
                 progress=fetch_progress)
    return write_from_mirror(ck, src, plan, dst, ranks, resume=resume, keep_cache=keep_cache,
                             progress=write_progress)


def write_from_mirror(ck: Checkpoint, src: RemoteSource, plan: Any, dst: Path, ranks: list[int], *,
                      resume: bool = False, keep_cache: bool = False,
                      progress: Callable[[int], None] | None = None):
    """The local writer over the (fetched) mirror; the mirror is dropped afterwards unless kept."""
    from exl3tools.slicing import write_rank_shards

    man = write_rank_shards(ck, plan, dst, resume=resume, progress=progress, ranks=ranks)
    if not keep_cache:
        drop_mirror(src)
    return man


def slices_dir(src: RemoteSource, tp: int, moe: str) -> Path:
    """The cache layout of rank-slice outputs: $HF_HOME/exl3tools/slices/models--ORG--NAME/COMMIT/tpN-MOE."""
    return cache_root().parent / "slices" / f"models--{src.repo.replace('/', '--')}" / src.commit / f"tp{tp}-{moe}"


def ensure_slices(spec: str, tp: int, moe: str = "tp", *, parallel: int = PARALLEL,
                  progress: Callable[[int], None] | None = None) -> Path:
    """A complete rank-slice output of REPO[@REV] for ``tp``/``moe`` in the cache (what ``serve REPO
    --tp N`` loads). Ranks already there (a manifest of this plan, or files a journal of an
    interrupted run records) are kept; only the ranges of the ranks still missing are fetched."""
    from exl3tools.checkpoint.manifest import MANIFEST_NAME
    from exl3tools.slicing import write_rank_shards
    from exl3tools.slicing.write import JOURNAL

    ck, src, plan = remote_plan(spec, tp, moe)
    dst = slices_dir(src, tp, moe)
    if (dst / MANIFEST_NAME).is_file():
        drop_mirror(src)
        return dst
    done: set[str] = set()
    try:
        for line in (dst / JOURNAL).read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and e.get("plan") == plan.fingerprint:
                done.add(str(e.get("path")))
    except FileNotFoundError:
        pass
    missing = [r for r in range(tp) if any(f"{plan.dirs[r]}/{sp.out_name}" not in done for sp in plan.shards)]
    fetch_ranges(src, needed_ranges(ck, plan_outputs(plan, missing)), parallel=parallel, progress=progress)
    write_rank_shards(ck, plan, dst, resume=dst.exists())  # --resume re-hashes what the journal records
    drop_mirror(src)
    return dst


def drop_mirror(src: RemoteSource) -> None:
    shutil.rmtree(src.mirror, ignore_errors=True)


def verify_remote(spec: str, sliced: Path, **kw):
    """verify SLICED against the repo: fetch afresh (into a temporary mirror) exactly the source ranges
    the manifest's tensors name, then compare byte for byte as the local verify does."""
    import tempfile

    from exl3tools.checkpoint.manifest import load_manifest
    from exl3tools.slicing import verify_sliced

    man = load_manifest(sliced)
    repo, rev = split_revision(spec.removeprefix("hf://"))
    if rev is None and man.source.repo == repo and man.source.revision:
        spec = f"{repo}@{man.source.revision}"
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".verify-", dir=root))
    try:
        ck, src = open_remote(spec, mirror=tmp)
        where = {n: f for f, h in ck.headers.items() for n in h.tensors}
        outs = [(where[s or n], (s or n, d, a, b)) for r in man.ranks for n, (s, d, a, b) in r.tensors.items()
                if (s or n) in where and d != "dequantize"]
        fetch_ranges(src, needed_ranges(ck, outs))
        return verify_sliced(tmp, sliced, **kw)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
