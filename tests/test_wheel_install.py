"""The built wheel, installed into a fresh venv (not editable), works as a new user runs it (issue 16
item 13): inspect and validate on the demo it ships, `exl3tools serve` with no PATH answering the
openai client, and the cuda backend finding its .cu source (no CUDA needed to look it up).

The venv has no system site-packages; a .pth appends this interpreter's site-packages after the
venv's own, for the third-party dependencies only (torch is 1 GB; `pip install` would only copy
it). That directory holds no importable exl3tools (the editable install's finder is activated by a
.pth file there, which Python only runs for site directories), and every command runs from a
temporary cwd, so each import of exl3tools comes from the installed wheel: the test asserts it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("setuptools")

from tests.conftest import REPO  # noqa: E402

BUILD_INPUTS = ["pyproject.toml", "README.md", "exl3tools", "cli", "kernels", "schemas", "demo"]


def sh(*args, cwd: Path, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    p = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout, **kw)
    assert p.returncode == 0, f"{args}: {p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # a copy: building in the worktree would leave build/ and *.egg-info there
    src.mkdir()
    for name in BUILD_INPUTS:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
       "-w", root / "dist", src, cwd=root)
    wheel = next((root / "dist").glob("exl3tools-*.whl"))
    env_dir = root / "venv"
    sh(sys.executable, "-m", "venv", "--without-pip", env_dir, cwd=root)
    py = env_dir / "bin" / "python"
    sh(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel, cwd=root)
    site = Path(sh(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root).stdout.strip())
    (site / "_exl3tools_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = root / "cwd"
    work.mkdir()
    return {"py": py, "cli": env_dir / "bin" / "exl3tools", "site": site, "cwd": work, "wheel": wheel}


def test_the_wheel_ships_the_demo_and_the_cuda_source(venv):
    import zipfile

    names = zipfile.ZipFile(venv["wheel"]).namelist()
    assert {f"exl3tools/kernels/csrc/{f}" for f in ("exl3_gemv.cu", "exl3_tiles.cuh", "exl3_wgmma.cuh",
                                                     "sm90_async.cuh", "mla_decode.cu")} <= set(names)
    assert "exl3tools/demo/glm4_moe-3.0bpw-mcg/model/model.safetensors" in names
    assert not any("goldens" in n for n in names)  # test data stays in the repository


def test_exl3tools_is_imported_from_the_venv_and_finds_its_data(venv):
    code = ("import exl3tools, exl3tools.cli.serve as s, exl3tools.kernels.cuda_build as cb; "
            "print(exl3tools.__file__); print(s.DEMO_MODEL); print(cb.SRC); print(cb.cubin_path(2, 1).name)")
    out = sh(venv["py"], "-c", code, cwd=venv["cwd"]).stdout.split()
    site = str(venv["site"])
    assert all(line.startswith(site) for line in out[:3]), out
    assert Path(out[1], "config.json").is_file() and Path(out[2]).is_file()
    from exl3tools.kernels import cuda_build  # the source tree's: the same source, the same cubin name

    assert out[3] == cuda_build.cubin_path(2, 1).name


def test_inspect_and_validate_the_shipped_demo(venv):
    demo = venv["site"] / "exl3tools" / "demo" / "glm4_moe-3.0bpw-mcg" / "model"
    out = sh(venv["cli"], "inspect", demo, "--json", cwd=venv["cwd"]).stdout
    assert '"architecture": "Glm4MoeForCausalLM"' in out
    sh(venv["cli"], "validate", demo, cwd=venv["cwd"])


def test_serve_without_a_path_serves_the_shipped_demo(venv):
    from tests.test_server_cli import free_port, wait_healthy

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen([str(venv["cli"]), "serve", "--port", str(port), "--log-level", "warning"],
                            cwd=venv["cwd"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = wait_healthy(proc, port)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model="glm4_moe-3.0bpw-mcg", prompt="Hello", max_tokens=3)
        assert r.usage.completion_tokens >= 1 and r.model == "glm4_moe-3.0bpw-mcg"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err
