"""bench/gpu_serve.py's server process: ``exl3tools serve`` started from a ``--config NAME:ARGS``
(leading ``EXL3TOOLS_X=V`` words its environment), waited for, queried and stopped (SIGINT, then
SIGTERM, then its process group killed). bench/gpu_serve_profile.py runs it the same way."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench_serve import free_port
from serve_measure import BenchError

REPO = Path(__file__).resolve().parents[1]
RESERVED_ARGS = ("--port", "--host", "--device")


class ServerDied(BenchError):
    pass


# ------------------------------------------------------------------ pure helpers (CPU-tested)
def config_env(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``EXL3TOOLS_*=VALUE`` words of a config's ARGS (the server's environment, e.g. the
    preview switches of runtime/preview.py) and the serve arguments after them."""
    env = {}
    while args and args[0].startswith("EXL3TOOLS_") and "=" in args[0]:
        k, v = args[0].split("=", 1)
        env[k], args = v, args[1:]
    return env, args


def parse_config(s: str) -> tuple[str, list[str]]:
    """``NAME:[EXL3TOOLS_X=V ...] ARGS`` -> (NAME, shlex-split words). Port, host and device belong to
    the script."""
    name, sep, rest = s.partition(":")
    name = name.strip()
    if not sep or not name or any(c in name for c in " /|"):
        raise argparse.ArgumentTypeError(f"--config takes NAME:ARGS, e.g. 'ml32k:--max-context 32768': {s!r}")
    args = shlex.split(rest)
    for x in args:
        if x.split("=", 1)[0] in RESERVED_ARGS:
            raise argparse.ArgumentTypeError(f"--config {name}: {x.split('=', 1)[0]} is set by the script")
    return name, args


def api_key_of(args: list[str]) -> str | None:
    for i, x in enumerate(args):
        if x == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if x.startswith("--api-key="):
            return x.split("=", 1)[1]
    return None


# ------------------------------------------------------------------ our server
class Server:
    def __init__(self, a, name: str, args: list[str], out: Path) -> None:
        self.env, args = config_env(args)
        self.name, self.args, self.port = name, args, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = api_key_of(args)
        self.log_path = out / f"serve_{name}.log"
        self.cmd = serve_command(a.ckpt, a.device, self.port, args)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if self.name.startswith("prof"):   # a config named prof*: cProfile of the engine thread
            env["EXL3TOOLS_PROFILE_ENGINE"] = str(self.log_path.with_suffix(".prof"))
        with open(self.log_path, "wb") as log:
            log.write((shlex.join(self.cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self, grace: float = 0.0) -> None:
        """Raise ServerDied if it exited (waiting up to ``grace`` s: a connection error can reach the
        client before the dying process can be reaped)."""
        if self.proc is not None and grace > 0:
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if not self.alive():
            raise ServerDied(f"server {self.name} exited with status {self.proc.returncode}")

    def wait_ready(self, timeout: float) -> float:
        import httpx

        t0 = time.monotonic()
        with httpx.Client(trust_env=False, timeout=5) as c:
            while True:
                self.check_alive()
                try:
                    if c.get(f"{self.url}/health").status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > timeout:
                    raise BenchError(f"server {self.name}: /health not 200 after {timeout:.0f} s")
                time.sleep(0.25)

    def get(self, path: str, timeout: float = 30):
        import httpx

        with httpx.Client(trust_env=False, timeout=timeout) as c:
            return c.get(f"{self.url}{path}", headers=self.headers())

    def stop(self, timeout: float) -> int | None:
        """SIGINT (clean shutdown), then SIGTERM, then SIGKILL of its process group."""
        p = self.proc
        if p is None:
            return None
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if p.poll() is not None:
                break
            try:
                if sig == signal.SIGKILL:
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)
                p.wait(wait)
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] still running {wait:.0f} s after {sig.name}", flush=True)
            except ProcessLookupError:
                break
        try:                                   # leftovers of its group (tensor-parallel workers)
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return p.returncode

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


def serve_command(ckpt: str, device: str, port: int, args: list[str]) -> list[str]:
    """``python -m exl3tools.cli serve`` when exl3tools.cli imports (installed, or linked as
    bench/gpu_all.sh does); else the same through a bootstrap that maps exl3tools.cli/kernels/schemas
    to the repo's top-level folders, as pyproject's package-dir does."""
    import importlib.util

    tail = ["serve", ckpt, "--device", device, "--host", "127.0.0.1", "--port", str(port), *args]
    try:
        ok = importlib.util.find_spec("exl3tools.cli") is not None
    except ImportError:
        ok = False
    if ok:
        return [sys.executable, "-m", "exl3tools.cli", *tail]
    boot = (f"import sys, exl3tools; exl3tools.__path__.append({str(REPO)!r}); "
            "sys.argv[0] = 'exl3tools'; from exl3tools.cli import main; main()")
    return [sys.executable, "-c", boot, *tail]
