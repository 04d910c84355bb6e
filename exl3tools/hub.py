"""Open a checkpoint by local path or Hugging Face repo id.

Order: a local directory; else the local hub cache (works offline); else, online, the small JSON
files plus every shard's safetensors header fetched by HTTP range request (no weights downloaded).

Offline, huggingface_hub retries each request five times with backoff (~30 s, then an
httpx ConnectError). So the first remote call is one request without retries and with a timeout
(``HUB_TIMEOUT_S``); if the Hub cannot be reached the command fails at once, in one line.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from exl3tools.checkpoint import DTYPES, Checkpoint, Header, TensorInfo
from exl3tools.checkpoint.counts import config_problems
from exl3tools.checkpoint.reader import TensorRef, load_json, merge_quantization_config
from exl3tools.errors import CheckpointError, NotFoundError

HUB_TIMEOUT_S = 10.0  # the first request to the Hub; HF_HUB_ETAG_TIMEOUT overrides it
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
SMALL_FILES = ["config.json", "quantization_config.json", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
               "special_tokens_map.json"]


def looks_like_repo_id(s: str) -> bool:
    return bool(REPO_ID.match(s)) and not s.startswith((".", "/", "~"))


def split_revision(spec: str) -> tuple[str, str | None]:
    repo, _, rev = spec.partition("@")
    return repo, rev or None


def open_source(spec: str) -> tuple[Checkpoint, str]:
    """(checkpoint, source) where source is 'local', 'hub-cache' or 'hub-headers'."""
    if Path(spec).exists() or not looks_like_repo_id(spec):
        return Checkpoint.open(spec), "local"
    repo, rev = split_revision(spec)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        local = snapshot_download(repo, revision=rev, local_files_only=True)
        return Checkpoint.open(local), "hub-cache"
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise NotFoundError(f"{spec}: not a local path and not in the Hugging Face cache (HF_HUB_OFFLINE=1)")
    return _open_remote_headers(repo, rev), "hub-headers"


def transport_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises when the network fails (httpx2, httpx or requests, by version;
    requests' errors are OSErrors)."""
    out: list[type[BaseException]] = [OSError]
    for mod in ("httpx2", "httpx"):  # only those the Hub client imported already
        err = getattr(sys.modules.get(mod), "TransportError", None)
        if isinstance(err, type):
            out.append(err)
    return tuple(out)


def _repo_files(repo: str, rev: str | None) -> set[str]:
    """The repository's file names: one request, no retries, bounded by a timeout."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_TIMEOUT_S)
    try:
        info = HfApi().model_info(repo, revision=rev, timeout=timeout)
    except HfHubHTTPError:
        raise  # the Hub answered: not found, gated, ... (handled by the caller)
    except transport_errors() as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise NotFoundError(f"{repo}: not a local path, not in the Hugging Face cache, and the Hub at "
                            f"{constants.ENDPOINT} cannot be reached ({type(exc).__name__}"
                            f"{': ' + why if why else ''})") from None
    return {s.rfilename for s in info.siblings or ()}


def _open_remote_headers(repo: str, rev: str | None) -> Checkpoint:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError

    try:
        files = _repo_files(repo, rev)
        local_dir = None
        for name in SMALL_FILES:
            if name in files:
                local_dir = Path(hf_hub_download(repo, name, revision=rev)).parent
        if local_dir is None:
            raise NotFoundError(f"{repo}: no config.json in the repository")
        meta = HfApi().get_safetensors_metadata(repo, revision=rev)
    except RepositoryNotFoundError:
        raise NotFoundError(f"{repo}: no such Hugging Face repository (or no access)") from None
    except NotFoundError:
        raise
    except (EntryNotFoundError, HfHubHTTPError, *transport_errors()) as exc:
        raise NotFoundError(f"{repo}: could not reach the Hub ({type(exc).__name__})") from None
    config = load_json(local_dir / "config.json", "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"hf://{repo}/config.json: not a JSON object")
    qfile = load_json(local_dir / "quantization_config.json", "quantization_config.json") \
        if (local_dir / "quantization_config.json").is_file() else None
    merged = merge_quantization_config(qfile, config.get("quantization_config"))
    headers: dict[str, Header] = {}
    tensors: dict[str, TensorRef] = {}
    for fname, fm in meta.files_metadata.items():
        infos = {}
        for name, ti in fm.tensors.items():
            b, e = ti.data_offsets
            if ti.dtype not in DTYPES:
                raise CheckpointError(f"hf://{repo}/{fname}: tensor {name!r} has unknown dtype {ti.dtype!r}")
            infos[name] = TensorInfo(name, ti.dtype, tuple(ti.shape), b, e)
            tensors[name] = TensorRef(Path(f"hf://{repo}/{fname}"), infos[name])
        size = max((t.end for t in infos.values()), default=0)
        headers[fname] = Header(f"hf://{repo}/{fname}", 0, 0, size, infos, fm.metadata)
    problems = config_problems(config, len(tensors))
    if problems:
        raise CheckpointError(f"hf://{repo}/config.json: {problems[0]}")
    return Checkpoint(Path(f"hf://{repo}"), config, merged, qfile, headers, tensors, None, [])
