"""bench/gpu_all.sh, the one script every device call runs, on the CPU: its bash parses, and the
wait for exllamav3's detached build returns at once where no build was started (with
EXL3_BUILD=0 and a carried .exl3so it once waited for a build log until the call's timeout and
spent the rest of a session's device time)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_all.sh"


def _bash():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash")
    return bash


def test_the_script_parses():
    r = subprocess.run([_bash(), "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _wait_build(tmp_path: Path, log: str | None, seconds: str = "") -> tuple[int, float]:
    """Run gpu_all.sh's wait_build alone, its build log at a private path (None: no log)."""
    text = SCRIPT.read_text()
    body = text[text.index("wait_build() {"):]
    body = body[:body.index("\n}\n") + 3].replace("/tmp/exl3build.log", str(tmp_path / "exl3build.log"))
    if log is not None:
        (tmp_path / "exl3build.log").write_text(log)
    # a file, not bash -c: pgrep -f would find the marker in this shell's own command line (it finds
    # none here unless a real build runs on this machine)
    script = tmp_path / "wait.sh"
    script.write_text(f"L={tmp_path}\n{body}\nwait_build {seconds}\n")
    t = time.monotonic()
    r = subprocess.run([_bash(), str(script)], capture_output=True, text=True, timeout=60)
    return r.returncode, time.monotonic() - t


def test_wait_build_returns_at_once_without_a_build(tmp_path):
    rc, took = _wait_build(tmp_path, None)
    assert rc == 0 and took < 5


def test_wait_build_waits_for_a_started_build(tmp_path):
    rc, _ = _wait_build(tmp_path, "exllamav3 ok\nbuild rc 0\n")          # ended: copied to $L
    assert rc == 0 and (tmp_path / "build.log").read_text().endswith("build rc 0\n")
    rc, took = _wait_build(tmp_path, "compiling\n", "4")                # running: waits, then rc 1
    assert rc == 1 and took >= 3.5
