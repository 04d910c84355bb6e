"""Checkpoint.open(dir): config, quantization_config, tokenizer files and a tensor index.

Only headers are read when opening. Tensor bytes are read on request, by byte ranges (pread),
never whole files, so a 700 GB checkpoint opens in milliseconds and bounded memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from exl3tools.checkpoint import jsonio
from exl3tools.checkpoint.counts import config_problems
from exl3tools.checkpoint.header import DTYPES, Header, TensorInfo, read_header
from exl3tools.errors import CheckpointError, NotACheckpointError, NotFoundError

INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json", "vocab.json",
                   "merges.txt", "added_tokens.json")


def merge_quantization_config(qfile: dict[str, Any] | None, qcfg: dict[str, Any] | None) -> dict[str, Any] | None:
    """One view of quantization_config.json (minus tensor_storage) and config.json's block; config.json wins."""
    if qfile is None and qcfg is None:
        return None
    merged = {k: v for k, v in (qfile or {}).items() if k != "tensor_storage"}
    merged.update(qcfg or {})
    return merged


def existing_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path; the one-line errors for a path that is missing or is not a folder."""
    root = Path(path)
    if not root.exists():
        raise NotFoundError(f"{root}: no such file or directory")
    if not root.is_dir():
        raise NotACheckpointError(f"{root}: not a directory (give the checkpoint folder)")
    return root


def nested_checkpoint_hint(root: Path) -> str:
    """For a folder without config.json: " (SUB has one: give that folder)" where exactly one
    subfolder holds config.json (a download's or the demo's model/), else "". Looks one level
    down, never deeper; an unreadable folder gives no hint."""
    try:
        subs = [p for p in sorted(root.iterdir()) if p.is_dir() and (p / "config.json").is_file()]
    except OSError:
        return ""
    return f" ({subs[0]} has one: give that folder)" if len(subs) == 1 else ""


def unsafe_file_name(fname: str) -> bool:
    """An index entry that is not a plain file name inside the checkpoint (path traversal)."""
    return "/" in fname or "\\" in fname or fname in ("", ".", "..")


@dataclass(frozen=True, slots=True)
class TensorRef:
    file: Path
    info: TensorInfo

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape


def load_json(path: Path, what: str) -> Any:
    """A checkpoint's JSON file, read by the one bounded reader (checkpoint/jsonio.py)."""
    return jsonio.load_json(path, what)


def json_file(root: Path, name: str) -> Path | None:
    """``root/name`` when it is a regular file, None when it does not exist; CheckpointError when it
    is something else (a FIFO would hang the reader, a directory is no config)."""
    p = root / name
    kind = jsonio.path_kind(p)
    if kind is None:
        return None
    if kind != "file":
        raise CheckpointError(jsonio.not_regular(p, name, kind))
    return p


@dataclass(slots=True)
class Checkpoint:
    root: Path
    config: dict[str, Any]
    quantization_config: dict[str, Any] | None   # the merged view (config.json wins on conflicts)
    quantization_config_file: dict[str, Any] | None
    headers: dict[str, Header]                   # file name -> header
    tensors: dict[str, TensorRef]
    index: dict[str, str] | None                 # weight_map when an index exists
    issues: list[tuple[str, str]] = field(default_factory=list)  # (code, message), non-fatal

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Open a checkpoint directory; raise on the first broken header, file or index entry.

        Problems loaders survive (a shard the index does not name, a tensor missing from the index,
        header oddities) are kept in ``issues``. validate has its own opener that records every
        problem instead of raising (validate.structure.open_tolerant).
        """
        root = existing_dir(path)
        cfg_path = json_file(root, "config.json")
        if cfg_path is None:
            raise NotACheckpointError(f"{root}: no config.json, not a Hugging Face checkpoint directory"
                                      + nested_checkpoint_hint(root))
        config = load_json(cfg_path, "config.json")
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_path}: config.json is not a JSON object")
        issues: list[tuple[str, str]] = []

        qfile = None
        qpath = json_file(root, "quantization_config.json")
        if qpath is not None:
            qfile = load_json(qpath, "quantization_config.json")
            if not isinstance(qfile, dict):
                raise CheckpointError(f"{qpath}: not a JSON object")
        qcfg = config.get("quantization_config")
        if qcfg is not None and not isinstance(qcfg, dict):
            raise CheckpointError(f"{cfg_path}: quantization_config is not an object")
        merged = merge_quantization_config(qfile, qcfg)

        index = None
        idx_path = json_file(root, INDEX_NAME)
        if idx_path is not None:
            idx = load_json(idx_path, INDEX_NAME)
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
                raise CheckpointError(f"{idx_path}: no valid weight_map")
            for fname in set(wm.values()):
                if unsafe_file_name(fname):
                    raise CheckpointError(f"{idx_path}: weight_map names file {fname!r} outside the checkpoint")
            index = wm
            files = sorted(set(wm.values()))
            extra = sorted(p.name for p in root.glob("*.safetensors") if p.name not in set(files))
            for name in extra:
                issues.append(("W101", f"{root / name}: safetensors file not referenced by {INDEX_NAME}"))
        else:
            files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise NotACheckpointError(f"{root}: no *.safetensors files")

        headers: dict[str, Header] = {}
        tensors: dict[str, TensorRef] = {}
        for fname in files:
            fpath = root / fname
            kind = jsonio.path_kind(fpath)
            if kind is None:
                raise CheckpointError(f"{fpath}: listed in {INDEX_NAME} but missing")
            if kind != "file":
                raise CheckpointError(jsonio.not_regular(fpath, "safetensors shard", kind))
            h = read_header(fpath)
            headers[fname] = h
            issues.extend(h.issues)
            for name, info in h.tensors.items():
                if name in tensors:
                    raise CheckpointError(f"{fpath}: tensor {name!r} also in {tensors[name].file.name}")
                tensors[name] = TensorRef(fpath, info)

        problems = config_problems(config, max(len(tensors), len(index or ())))
        if problems:  # every loop over layers, experts and heads takes its bound from these counts
            raise CheckpointError(f"{cfg_path}: {problems[0]}")
        if index is not None:
            for name, fname in index.items():
                if fname in headers and name not in headers[fname].tensors:
                    raise CheckpointError(f"{root / fname}: tensor {name!r} listed in {INDEX_NAME} but not in the file")
            for name, ref in tensors.items():
                if name not in index:
                    issues.append(("E112", f"{ref.file}: tensor {name!r} not listed in {INDEX_NAME} (loaders skip it)"))
                elif index[name] != ref.file.name:
                    issues.append(("E111", f"{ref.file}: tensor {name!r} indexed in {index[name]}"))
        return cls(root, config, merged, qfile, headers, tensors, index, issues)

    # ---------------------------------------------------------------- facts
    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
        return str(self.config.get("model_type", "unknown"))

    @property
    def is_exl3(self) -> bool:
        return bool(self.quantization_config and self.quantization_config.get("quant_method") == "exl3")

    @property
    def total_bytes(self) -> int:
        return sum(t.info.nbytes for t in self.tensors.values())

    @property
    def file_bytes(self) -> int:
        return sum(h.file_size for h in self.headers.values())

    def tokenizer_files(self) -> list[Path]:
        return [self.root / f for f in TOKENIZER_FILES if (self.root / f).is_file()]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def ref(self, name: str) -> TensorRef:
        from exl3tools.errors import MissingTensorError

        try:
            return self.tensors[name]
        except KeyError:
            raise MissingTensorError(f"{self.root}: tensor {name!r} not in checkpoint") from None

    # ---------------------------------------------------------------- reading bytes
    def read_bytes(self, name: str) -> bytes:
        ref = self.ref(name)
        return pread_exact(ref.file, ref.info.begin, ref.info.nbytes)

    def read_slice_bytes(self, name: str, dim: int, start: int, stop: int) -> bytes:
        """Bytes of ``tensor[..., start:stop, ...]`` along ``dim``, read as contiguous runs."""
        ref = self.ref(name)
        runs = slice_runs(ref.info.shape, ref.info.itemsize, dim, start, stop)
        with open(ref.file, "rb", buffering=0) as f:
            fd = f.fileno()
            return b"".join(pread_fd(fd, ref.info.begin + off, n, ref.file) for off, n in runs)

    def read_numpy(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (BF16 -> float32 exactly; F8 -> raw uint8)."""
        ref = self.ref(name)
        return to_numpy(self.read_bytes(name), ref.info.dtype, ref.info.shape)

    def read_numpy_slice(self, name: str, dim: int, start: int, stop: int) -> np.ndarray:
        ref = self.ref(name)
        shape = list(ref.info.shape)
        shape[dim] = stop - start
        return to_numpy(self.read_slice_bytes(name, dim, start, stop), ref.info.dtype, tuple(shape))


def to_numpy(raw: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "BF16":
        u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    npd = DTYPES[dtype][1] or "u1"
    return np.frombuffer(raw, dtype=npd).reshape(shape).copy()


def slice_runs(shape: tuple[int, ...], itemsize: int, dim: int, start: int, stop: int) -> list[tuple[int, int]]:
    """Byte runs (offset, length) of a C-contiguous tensor covering ``[start:stop]`` along ``dim``.

    Adjacent runs are merged, so a cut along dim 0 is a single run.
    """
    if not (0 <= dim < len(shape)) or not (0 <= start <= stop <= shape[dim]):
        raise ValueError(f"bad slice dim={dim} [{start}:{stop}] of shape {shape}")
    inner = math.prod(shape[dim + 1:]) * itemsize
    outer = math.prod(shape[:dim])
    row = shape[dim] * inner
    n = (stop - start) * inner
    if n == 0:
        return []
    if stop - start == shape[dim]:
        return [(0, outer * row)]
    return [(o * row + start * inner, n) for o in range(outer)]


def pread_fd(fd: int, offset: int, n: int, path: Path | None = None) -> bytes:
    """Exactly n bytes at offset (pread loops on short reads); CheckpointError at end of file."""
    chunks = []
    while n > 0:
        b = os.pread(fd, min(n, 1 << 30), offset)
        if not b:
            name = path if path is not None else _fd_name(fd)
            raise CheckpointError(f"{name}: file ends before byte {offset + n} (truncated)")
        chunks.append(b)
        offset += len(b)
        n -= len(b)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _fd_name(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


def pread_exact(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return pread_fd(f.fileno(), offset, n, path)
