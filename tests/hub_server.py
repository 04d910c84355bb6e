"""A real HTTP server on 127.0.0.1 that serves a local checkpoint directory as a Hugging Face model repo.

It answers the endpoints huggingface_hub uses: ``/api/models/{repo}[/revision/{rev}]`` (model_info),
``/api/models/{repo}/tree/{rev}`` (snapshot_download's listing) and ``/{repo}/resolve/{rev}/{file}``
(HEAD and GET, with single ``Range: bytes=a-b`` requests answered 206). Safetensors files are served
like LFS files: ``ETag``/``X-Linked-Etag`` are their sha256, ``X-Linked-Size`` their size; every
response carries ``X-Repo-Commit``. Every GET of a file is logged with the bytes actually sent, so
tests can count what a client fetched. Knobs a test may set: ``drop_once`` (file -> close the socket
after that many bytes of the next GET of it, once, or ``drop_times`` times), ``flip_commit_after`` (after that many range GETs
of safetensors files, the revision points to another commit).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


@dataclass
class Get:
    file: str
    start: int
    end: int          # exclusive, as requested
    sent: int         # bytes actually written to the socket
    ranged: bool


@dataclass
class HubState:
    root: Path
    repo: str
    commit: str = COMMIT_A
    drop_once: dict[str, int] = field(default_factory=dict)
    drop_times: int = 1   # how many GETs drop_once cuts short before it is spent
    flip_commit_after: int | None = None
    gets: list[Get] = field(default_factory=list)
    connections: int = 0  # TCP connections accepted: keep-alive means far fewer than GETs
    overrun: int = 0      # hostile: ranged answers carry this many bytes more than asked (Content-Length too)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _sha: dict[str, str] = field(default_factory=dict)

    def files(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_file())

    def sha256(self, name: str) -> str:
        if name not in self._sha:
            self._sha[name] = hashlib.sha256((self.root / name).read_bytes()).hexdigest()
        return self._sha[name]

    def fetched(self, file: str | None = None) -> int:
        return sum(g.sent for g in self.gets if file is None or g.file == file)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else each small response waits ~40 ms for a delayed ACK
    state: HubState  # set on the subclass made per server

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:  # once per TCP connection
        super().setup()
        with self.state.lock:
            self.state.connections += 1

    def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
              head: bool = False) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json",
                                                    "X-Repo-Commit": self.state.commit})

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        st = self.state
        path = unquote(urlparse(self.path).path)
        api = f"/api/models/{st.repo}"
        if not (path.startswith(api + "/") or path == api or path.startswith(f"/{st.repo}/")):
            return self._send(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
        if path == api or re.fullmatch(re.escape(api) + r"/revision/[^/]+", path):
            return self._json({"id": st.repo, "modelId": st.repo, "sha": st.commit, "private": False,
                               "siblings": [{"rfilename": f} for f in st.files()], "tags": []})
        if re.fullmatch(re.escape(api) + r"/tree/[^/]+/?", path):
            out = []
            for f in st.files():
                size = (st.root / f).stat().st_size
                e = {"type": "file", "path": f, "size": size, "oid": hashlib.sha1(f.encode()).hexdigest()}
                if f.endswith(".safetensors"):
                    e["lfs"] = {"oid": st.sha256(f), "size": size, "pointerSize": 134}
                out.append(e)
            return self._json(out)
        m = re.fullmatch("/" + re.escape(st.repo) + r"/resolve/([^/]+)/(.+)", path)
        if m is None or m.group(2) not in st.files():
            return self._send(404, b'{"error":"Entry not found"}', {"X-Error-Code": "EntryNotFound",
                                                                    "X-Repo-Commit": st.commit}, head)
        return self._file(m.group(2), head)

    def _file(self, name: str, head: bool) -> None:
        st = self.state
        p = st.root / name
        size = p.stat().st_size
        lfs = name.endswith(".safetensors")
        etag = st.sha256(name) if lfs else hashlib.sha1(p.read_bytes()).hexdigest()
        hdr = {"X-Repo-Commit": st.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if lfs:
            hdr.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(size)})
        if head:
            return self._head(hdr, size)
        rng = self.headers.get("Range")
        start, end, code = 0, size, 200
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m is None or int(m.group(1)) >= size:
                return self._send(416, b"", {"Content-Range": f"bytes */{size}"})
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            code = 206
            hdr["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        with st.lock:
            drop = st.drop_once.get(name) if rng else None
            if drop is not None:
                st.drop_times -= 1
                if st.drop_times <= 0:
                    del st.drop_once[name]
            if lfs and rng and st.flip_commit_after is not None:
                st.flip_commit_after -= 1
                if st.flip_commit_after < 0:
                    st.commit = COMMIT_B
                    hdr["X-Repo-Commit"] = st.commit
        self.send_response(code)
        for k, v in hdr.items():
            self.send_header(k, v)
        over = st.overrun if rng else 0
        self.send_header("Content-Length", str(end - start + over))
        self.end_headers()
        if over:
            self.wfile.write(b"\0" * over)   # the asked bytes are not even first: never written anywhere
        sent = 0
        with open(p, "rb") as f:
            f.seek(start)
            while sent < end - start:
                n = min(1 << 16, end - start - sent)
                if drop is not None:
                    n = min(n, drop - sent)
                    if n <= 0:
                        break
                self.wfile.write(f.read(n))
                sent += n
        with st.lock:
            st.gets.append(Get(name, start, end, sent, bool(rng)))
        if drop is not None:
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)

    def _head(self, hdr: dict[str, str], size: int) -> None:
        self.send_response(200)
        for k, v in hdr.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(size))
        self.end_headers()


def hub_settings(url: str, home: Path) -> tuple[dict[str, str], dict[str, object]]:
    """(environment, huggingface_hub.constants) values that point an already imported huggingface_hub
    at ``url`` with its home (token, caches) in ``home``; HF_HUB_OFFLINE and HF_TOKEN are unset."""
    env = {"HF_ENDPOINT": url, "HF_HOME": str(home)}
    consts = {"ENDPOINT": url, "HUGGINGFACE_CO_URL_TEMPLATE": url + "/{repo_id}/resolve/{revision}/{filename}",
              "HF_HOME": str(home), "HF_HUB_CACHE": str(Path(home) / "hub"), "HF_HUB_OFFLINE": False}
    return env, consts


class FakeHub:
    """``with FakeHub(model_dir, "org/name") as hub: hub.url`` -> http://127.0.0.1:PORT."""

    def __init__(self, root: Path, repo: str):
        self.state = HubState(Path(root), repo)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # shutdown() waits for serve_forever's next poll: 0.5 s by default, at every test's end
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
