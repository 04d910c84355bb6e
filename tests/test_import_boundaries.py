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


def test_plan_and_diff_are_torch_free():
    mods = _modules_after(
        "import exl3tools.plan, exl3tools.cli.plan, exl3tools.diff, exl3tools.cli.diff\n"
        "from exl3tools.checkpoint import Checkpoint\n"
        f"exl3tools.plan.plan_memory(Checkpoint.open({str(DEMO / 'model')!r}), gpu='h200', gpu_total=2**37, tp=2, moe='ep')\n"
        f"exl3tools.diff.diff_checkpoints(Checkpoint.open({str(DEMO / 'model')!r}), Checkpoint.open({str(DEMO / 'model')!r}))")
    assert "torch" not in mods and "cli" not in mods


def test_cli_inspect_run_is_torch_free():
    mods = _modules_after(
        "import sys\nfrom exl3tools.cli import main\n"
        f"sys.argv = ['exl3tools', 'inspect', {str(DEMO / 'model')!r}, '--json']\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n        main()\n    except SystemExit:\n        pass")
    assert "torch" not in mods


# Each subpackage's modules, bottom floor first: a module may import only floors below it (checked on
# the source, function-level imports included), so the stages cannot grow an import circle again.
FLOORS = {
    "exl3tools.validate": ["rules", "findings", "context", "structure", "linears", "architecture", "numeric",
                           "deep", "single", "ranks", "report", "__init__"],
    "exl3tools.slicing": ["cuts", "plan", "write", "vllm_hybrid", "verify", "__init__"],
}


def _sibling_imports(package: str, path) -> set[str]:
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == package:
                found.update(a.name for a in node.names)
            elif node.module.startswith(package + "."):
                found.add(node.module[len(package) + 1:].split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name[len(package) + 1:].split(".")[0] for a in node.names
                         if a.name.startswith(package + "."))
    return found


def test_subpackages_import_downward_only():
    from tests.conftest import REPO

    for package, floors in FLOORS.items():
        folder = REPO / package.replace(".", "/")
        assert sorted(p.stem for p in folder.glob("*.py")) == sorted(floors), f"{package}: update FLOORS"
        for i, mod in enumerate(floors):
            imported = _sibling_imports(package, folder / f"{mod}.py") & set(floors)
            upward = imported - set(floors[:i])
            assert not upward, f"{package}.{mod} imports {sorted(upward)}, which are not below it"
