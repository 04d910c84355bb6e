"""The offline core never imports torch (nor the server, nor exllamav3), and bare `cli`/`kernels` never load."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import DEMO


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_core_and_inspect_are_torch_free():
    mods = _modules_after(
        "import exl3tools.checkpoint, exl3tools.layout, exl3tools.inspect, exl3tools.hub, exl3tools.kernels.reference\n"
        "import exl3tools.cli, exl3tools.cli.inspect\n"
        f"from exl3tools.inspect import summarize, inspect_tensor\n"
        f"from exl3tools.checkpoint import Checkpoint\n"
        f"ck = Checkpoint.open({str(DEMO / 'model')!r}); summarize(ck, tp=2)\n"
        f"inspect_tensor(ck, 'lm_head')")
    assert "torch" not in mods and "exllamav3" not in mods and "fastapi" not in mods
    assert "cli" not in mods and "kernels" not in mods


def test_cli_inspect_run_is_torch_free():
    mods = _modules_after(
        "import sys\nfrom exl3tools.cli import main\n"
        f"sys.argv = ['exl3tools', 'inspect', {str(DEMO / 'model')!r}, '--json']\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main()\n    except SystemExit:\n        pass")
    assert "torch" not in mods
