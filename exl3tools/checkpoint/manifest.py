"""rank-slice manifest (docs/rank-slice.md §5): frozen dataclasses <-> JSON, checked by a JSON schema.

The manifest is written last; its presence is what makes a sliced output "complete".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from exl3tools.checkpoint import jsonio
from exl3tools.checkpoint.reader import existing_dir
from exl3tools.errors import IncompleteOutputError

SCHEMA_NAME = "exl3tools.rank_manifest"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_TP = 4096  # ranks one manifest may declare; rank-slice itself writes at most 256

# name -> [src | None, dim | None | "dequantize", start | None, stop | None]
SliceSpec = tuple[str | None, int | str | None, int | None, int | None]


_name = json.encoder.encode_basestring_ascii       # what json.dumps(str) writes, without its per-call setup
_compact = json.JSONEncoder(separators=(",", ":")).encode  # one encoder, not one per tensor


@dataclass(frozen=True, slots=True)
class SourceFile:
    name: str
    size: int
    header_sha256: str


@dataclass(frozen=True, slots=True)
class SourceInfo:
    path: str
    fingerprint: str
    architecture: str
    config_sha256: str
    files: tuple[SourceFile, ...]
    repo: str | None = None        # a Hugging Face repo id, when sliced straight from the Hub
    revision: str | None = None    # the commit sha that repo's revision resolved to


@dataclass(frozen=True, slots=True)
class RankEntry:
    rank: int | None
    dir: str
    tensor_bytes: int
    tensors: Mapping[str, SliceSpec]   # a dict when loaded; a lazy view over the plan when written


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class RankManifest:
    tool_version: str
    layout: str
    tp: int
    moe: str
    source: SourceInfo
    plan_fingerprint: str
    ranks: tuple[RankEntry, ...]
    files: dict[str, FileEntry] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def dump(self, fh: Any) -> None:
        """Write the same JSON as ``to_json`` (compact), streaming the per-tensor entries so that a
        million-tensor manifest never exists as one Python object tree or string."""
        head = self.to_json(with_tensors=False)
        files = head.pop("files")
        ranks = head.pop("ranks")
        fh.write(json.dumps(head, separators=(",", ":"))[:-1])
        fh.write(',"ranks":[')
        for i, (r, rj) in enumerate(zip(self.ranks, ranks, strict=True)):
            fh.write("," if i else "")
            fh.write(json.dumps(rj, separators=(",", ":"))[:-1] + ',"tensors":{')
            for j, (name, spec) in enumerate(r.tensors.items()):
                fh.write(("," if j else "") + _name(name) + ":" + _compact(list(spec)))
            fh.write("}}")
        fh.write('],"files":' + json.dumps(files, separators=(",", ":")) + "}\n")

    def to_json(self, with_tensors: bool = True) -> dict[str, Any]:
        return {
            "schema": SCHEMA_NAME,
            "schema_version": self.schema_version,
            "tool_version": self.tool_version,
            "layout": self.layout,
            "tp": self.tp,
            "moe": self.moe,
            "source": {
                "path": self.source.path, "fingerprint": self.source.fingerprint,
                "architecture": self.source.architecture, "config_sha256": self.source.config_sha256,
                "files": [{"name": f.name, "size": f.size, "header_sha256": f.header_sha256}
                          for f in self.source.files],
                **({"repo": self.source.repo, "revision": self.source.revision} if self.source.repo else {}),
            },
            "plan_fingerprint": self.plan_fingerprint,
            "ranks": [{"rank": r.rank, "dir": r.dir, "tensor_bytes": r.tensor_bytes,
                       **({"tensors": {k: list(v) for k, v in r.tensors.items()}} if with_tensors else {})}
                      for r in self.ranks],
            "files": {k: {"size": v.size, "sha256": v.sha256} for k, v in sorted(self.files.items())},
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RankManifest:
        src = obj["source"]
        return cls(
            tool_version=obj["tool_version"], layout=obj["layout"], tp=obj["tp"], moe=obj["moe"],
            source=SourceInfo(src["path"], src["fingerprint"], src["architecture"], src["config_sha256"],
                              tuple(SourceFile(f["name"], f["size"], f["header_sha256"]) for f in src["files"]),
                              src.get("repo"), src.get("revision")),
            plan_fingerprint=obj["plan_fingerprint"],
            ranks=tuple(RankEntry(r["rank"], r["dir"], r["tensor_bytes"],
                                  {k: tuple(v) for k, v in r["tensors"].items()}) for r in obj["ranks"]),
            files={k: FileEntry(v["size"], v["sha256"]) for k, v in obj["files"].items()},
            schema_version=obj["schema_version"],
        )


def schema() -> dict[str, Any]:
    text = resources.files("exl3tools.schemas").joinpath("rank_manifest.v1.json").read_text()
    return json.loads(text)


def check_schema(obj: Any) -> None:
    """Raise IncompleteOutputError if ``obj`` does not match schemas/rank_manifest.v1.json.

    jsonschema checks everything but the per-tensor entries (a million of them would take minutes);
    those are checked here with the same rules, in one fast loop.
    """
    import jsonschema

    stripped = obj
    if isinstance(obj, dict) and isinstance(obj.get("ranks"), list):
        stripped = {**obj, "ranks": [{**r, "tensors": {}} if isinstance(r, dict) else r for r in obj["ranks"]]}
    try:
        jsonschema.validate(stripped, schema())
    except jsonschema.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        raise IncompleteOutputError(f"manifest.json does not match its schema at '{path}': {exc.message}") from None
    # plausibility beyond the schema: every count a consumer may loop over is bounded by what is stored
    tp, ranks = obj["tp"], obj["ranks"]
    if tp > MAX_TP:
        raise IncompleteOutputError(f"manifest.json: tp {tp} is not plausible (at most {MAX_TP})")
    if len(ranks) > tp:
        raise IncompleteOutputError(f"manifest.json: {len(ranks)} rank entries for tp {tp}")
    for i, r in enumerate(ranks):
        if r["rank"] is not None and r["rank"] >= tp:
            raise IncompleteOutputError(f"manifest.json: ranks/{i}/rank is {r['rank']}, tp is {tp}")
        tensors = r.get("tensors")
        if not isinstance(tensors, dict):
            raise IncompleteOutputError(f"manifest.json: ranks/{i}/tensors is not an object")
        for name, spec in tensors.items():
            if not _spec_ok(spec):
                raise IncompleteOutputError(f"manifest.json does not match its schema at "
                                            f"'ranks/{i}/tensors/{name}': {spec!r} is not "
                                            "[src, dim, start, stop] with start <= stop")


def _nat(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _spec_ok(spec: Any) -> bool:
    if not (isinstance(spec, list) and len(spec) == 4):
        return False
    src, dim, a, b = spec
    return ((src is None or isinstance(src, str)) and (dim is None or dim == "dequantize" or _nat(dim))
            and (a is None or _nat(a)) and (b is None or _nat(b)) and (a is None or b is None or a <= b))


def read_manifest_json(path: Path) -> Any:
    """The parsed manifest.json at ``path`` (bounded, regular files only); IncompleteOutputError if it
    cannot be read or parsed."""
    return jsonio.load_json(path, MANIFEST_NAME, limit=jsonio.MAX_MANIFEST_BYTES, error=IncompleteOutputError)


def load_manifest(out_dir: str | Path) -> RankManifest:
    """The manifest of a sliced output; IncompleteOutputError when absent (never finished) or bad."""
    p = existing_dir(out_dir) / MANIFEST_NAME  # no such folder at all: NotFoundError (exit 2)
    if jsonio.path_kind(p) is None:
        raise IncompleteOutputError(f"{out_dir}: no {MANIFEST_NAME}: the output was never completed "
                                    "(rerun rank-slice with --resume)")
    obj = read_manifest_json(p)
    check_schema(obj)
    return RankManifest.from_json(obj)


def sha256_file(path: str | Path, bufsize: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(bufsize)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
