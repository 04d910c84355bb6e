"""Issue 16, the CLI half: generate/serve/inspect answer bad options, missing extras and no network
with one line and a documented exit code (never 70, "internal error"), before loading the model;
and loading shows progress."""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from exl3tools.cli import main

from tests.conftest import DEMO, cuda_available

MODEL = DEMO / "model"


def run(*args, env: dict | None = None):
    return CliRunner().invoke(main, list(map(str, args)), env=env)


@pytest.fixture
def never_binds(monkeypatch):
    """serve must refuse before it binds: a server that starts fails the test instead of hanging it."""
    import uvicorn

    def run(self, *a, **k):
        raise AssertionError("serve started a server")

    monkeypatch.setattr(uvicorn.Server, "run", run)


def one_line_error(res, code: int, text: str) -> None:
    assert res.exit_code == code, res.output
    assert text in res.output, res.output
    assert "Traceback" not in res.output and "internal error" not in res.output
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


# ----------------------------------------------------------------------------- item 9: generate


@pytest.mark.parametrize("opts,text", [
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--temperature", "-1"], "--temperature must be >= 0, got -1"),
    (["--temperature", "1e-46"], "underflows the float32 sampler"),
    (["--top-p", "nan"], "--top-p must be a finite number"),
    (["--top-p", "1e-46"], "underflows the float32 sampler"),
    (["--top-p", "0"], "--top-p must be > 0 and <= 1, got 0"),
    (["--device", "bogus"], "--device 'bogus': use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "use auto, cpu, cuda or cuda:N"),
])
def test_generate_bad_options_are_usage_errors(opts, text):
    one_line_error(run("generate", MODEL, "--token-ids", "1,2", *opts), 2, text)


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_device_cuda_without_cuda_is_a_usage_error(cmd, never_binds):
    args = ["generate", MODEL, "--token-ids", "1"] if cmd == "generate" else ["serve", MODEL, "--port", "0"]
    one_line_error(run(*args, "--device", "cuda"), 2, "no CUDA device here")


def test_logits_out_into_a_missing_folder_fails_before_generating(tmp_path):
    res = run("generate", MODEL, "--prompt", "Hello", "--max-tokens", 4, "--ignore-eos",
              "--logits-out", tmp_path / "no" / "such" / "l.safetensors")
    one_line_error(res, 2, "does not exist")
    assert res.stdout == ""  # nothing was generated


def test_context_overflow_is_refused_before_generating():
    res = run("generate", MODEL, "--token-ids", "1,2,3", "--max-tokens", 4094, "--ignore-eos")
    one_line_error(res, 2, "exceeds the model's context of 4096 tokens")
    assert res.stdout == ""


@pytest.mark.parametrize("content,code,text", [
    (b"{not json", 1, "not a readable tokenizer"),
    (b"\xff\xfe", 1, "not a readable tokenizer"),
    (b'{"version": "1.0"}', 1, "not a readable tokenizer"),
])
def test_a_broken_tokenizer_json_is_a_checkpoint_error(tmp_path, content, code, text):
    d = tmp_path / "m"
    shutil.copytree(MODEL, d)
    (d / "tokenizer.json").write_bytes(content)
    one_line_error(run("generate", d, "--prompt", "hi"), code, text)


# ----------------------------------------------------------------------------- item 4/16: serve keys


NO_KEYS = {"EXL3TOOLS_SERVE_API_KEY": None, "EXL3TOOLS_SERVE_API_KEYS": None, "VLLM_API_KEY": None}  # None: unset


@pytest.mark.parametrize("args,env,text", [
    (["--api-key", ""], {}, "an API key must not be empty"),
    (["--api-key", "ok", "--api-key", "  "], {}, "an API key must not be empty"),
    ([], {"EXL3TOOLS_SERVE_API_KEY": ""}, "EXL3TOOLS_SERVE_API_KEY is set but empty"),
    ([], {"EXL3TOOLS_SERVE_API_KEYS": " "}, "EXL3TOOLS_SERVE_API_KEYS is set but empty"),
    ([], {**NO_KEYS, "VLLM_API_KEY": ""}, "VLLM_API_KEY is set but empty"),
    (["--metrics-require-key"], NO_KEYS, "--metrics-require-key needs an API key"),
    (["--device", "bogus"], {}, "use auto, cpu, cuda or cuda:N"),
])
def test_serve_refuses_empty_keys_and_bad_devices_before_binding(args, env, text, never_binds):
    one_line_error(run("serve", MODEL, "--port", "0", *args, env=env), 2, text)


def test_serve_refuses_a_checkpoint_without_a_tokenizer_before_binding(tmp_path, never_binds):
    d = tmp_path / "m"
    shutil.copytree(MODEL, d)
    (d / "tokenizer.json").unlink()
    one_line_error(run("serve", d, "--port", "0"), 1, "no tokenizer.json; serve answers in text")
    # a rank-slice output keeps the tokenizer in each rank's folder, not at its root: served, and
    # refused only without rank 0's
    out = tmp_path / "tp2"
    assert run("rank-slice", MODEL, out, "--tp", "2", "--moe", "ep").exit_code == 0
    assert not (out / "tokenizer.json").exists() and (out / "rank-0-of-2" / "tokenizer.json").is_file()
    res = run("serve", out, "--tp", "2", "--moe", "ep", "--port", "0")
    assert "serve started a server" in res.output, res.output     # (never_binds: past every check)
    (out / "rank-0-of-2" / "tokenizer.json").unlink()
    one_line_error(run("serve", out, "--tp", "2", "--moe", "ep", "--port", "0"), 1, "rank-0-of-2: no tokenizer.json")


def serve_api_keys(args: list[str]) -> tuple[str, ...]:
    """The api_keys serve would start with (click's parse, env vars included), without starting."""
    parent = main.make_context("exl3tools", ["serve", *args])
    cmd = main.get_command(parent, "serve")
    return cmd.make_context("serve", list(args), parent=parent).params["api_keys"]


def test_both_api_key_env_vars_are_read(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("EXL3TOOLS_SERVE_API_KEYS", raising=False)
    monkeypatch.setenv("EXL3TOOLS_SERVE_API_KEY", "single")
    assert serve_api_keys([]) == ("single",)
    monkeypatch.setenv("EXL3TOOLS_SERVE_API_KEYS", "a b")
    assert serve_api_keys([]) == ("a", "b", "single")
    assert serve_api_keys(["--api-key", "cli"]) == ("cli",)  # the command line wins
    monkeypatch.delenv("EXL3TOOLS_SERVE_API_KEY")
    monkeypatch.delenv("EXL3TOOLS_SERVE_API_KEYS")
    assert serve_api_keys([]) == ()


def test_vllm_api_key_is_read_after_ours(monkeypatch):
    """Precedence: --api-key, then EXL3TOOLS_SERVE_API_KEY(S), then vLLM's VLLM_API_KEY."""
    for name in ("EXL3TOOLS_SERVE_API_KEY", "EXL3TOOLS_SERVE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_API_KEY", " from-vllm ")
    assert serve_api_keys([]) == ("from-vllm",)
    assert serve_api_keys(["--api-key", "cli"]) == ("cli",)
    monkeypatch.setenv("EXL3TOOLS_SERVE_API_KEY", "ours")
    assert serve_api_keys([]) == ("ours",)
    monkeypatch.delenv("EXL3TOOLS_SERVE_API_KEY")
    monkeypatch.setenv("EXL3TOOLS_SERVE_API_KEYS", "a b")
    assert serve_api_keys([]) == ("a", "b")
    monkeypatch.setenv("VLLM_API_KEY", "")       # shadowed by ours: not read, so not refused
    assert serve_api_keys([]) == ("a", "b")


# ----------------------------------------------------------------------------- item 16: progress


def test_loading_reports_progress(monkeypatch):
    from exl3tools.cli import _output
    from exl3tools.cli._runtime import LoadProgress
    from rich.console import Console

    from exl3tools.checkpoint.reader import Checkpoint
    from exl3tools.runtime import weights
    from exl3tools.runtime.runner import load_runner

    buf = io.StringIO()
    monkeypatch.setattr(_output, "err_console", Console(file=buf, force_terminal=True, width=120))
    with LoadProgress() as progress:
        runner = load_runner(MODEL)
    runner.close()
    assert weights.progress_hook is None
    total = sum(r.info.nbytes for r in Checkpoint.open(MODEL).tensors.values())
    assert progress.tensors > 10 and progress.bytes == total  # every tensor read once
    shown = buf.getvalue()
    assert "loading weights" in shown and f"{progress.tensors} tensors" in shown


# ----------------------------------------------------------------------------- item 15: extras


@pytest.mark.parametrize("blocked,args,extra", [
    ("torch", ["generate", str(MODEL), "--prompt", "hi"], "runtime"),
    ("uvicorn", ["serve", "--port", "0"], "serve"),
    ("opentelemetry", ["serve", "--port", "0"], "serve"),   # fastapi's own dependency (0.165+)
    ("annotated_doc", ["serve", "--port", "0"], "serve"),
])
def test_a_core_install_names_the_missing_extra(tmp_path, blocked, args, extra):
    code = (f"import sys; sys.modules[{blocked!r}] = None; sys.argv = ['exl3tools', *{args!r}]; "
            "from exl3tools.cli import main; main()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert f"pip install 'exl3tools[{extra}]'" in p.stderr and blocked in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- item 14: no network


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_inspect_a_repo_id_without_network_fails_fast(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_HOME=str(tmp_path / "hf"),
               HF_HUB_DISABLE_TELEMETRY="1")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "exl3tools.cli", "inspect", "someone/some-exl3-model"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    assert "cannot be reached" in p.stderr and "someone/some-exl3-model" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert elapsed < 15, f"{elapsed:.1f} s (huggingface_hub's retries take ~30 s)"
