"""What a vLLM user moving to `exl3tools serve` expects: CORS, --chat-template, the chat template
files in transformers' order, generation_config.json's defaults (--generation-config), vLLM's flag
names (-tp, several --served-model-name, --seed) and /health's load progress. Real servers on
127.0.0.1 over the demo checkpoint."""

from __future__ import annotations

import json
import shutil
import signal
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402
from tests.test_server_cli import free_port, serve, wait_healthy  # noqa: E402

ORIGIN = "http://ui.example"
KEY = {"Authorization": "Bearer k"}
MSGS = [{"role": "user", "content": "Hello!"}]
# renders the messages as "[role] content" lines: a template no checkpoint file holds
MARKED = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def _copy(tmp_path, name: str = "model") -> object:
    dst = tmp_path / name
    shutil.copytree(DEMO / "model", dst)
    return dst


def _encode(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEMO / "model" / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def _chat_ids(url: str, headers: dict | None = None, model: str = "demo") -> list[int]:
    """The prompt tokens a chat completion of MSGS starts from (vLLM's /tokenize with messages)."""
    r = httpx.post(f"{url}/tokenize", json={"model": model, "messages": MSGS, "add_generation_prompt": False},
                   headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ------------------------------------------------------------------------------------------- CORS


def test_cors_preflight_bypasses_the_key_and_answers_allowed_origins_only():
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", api_keys=("k",),
                      allowed_origins=(ORIGIN,))
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    body = {"model": "demo", "prompt": "hi", "max_tokens": 2}
    with LiveServer(create_app(cfg)) as s:
        # a browser's preflight carries no key: 200 from the CORS layer, not the gate's 401
        r = httpx.options(f"{s.url}/v1/chat/completions", headers=preflight)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        ok = httpx.post(f"{s.url}/v1/completions", json=body, headers={**KEY, "Origin": ORIGIN})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        # the key is still required for the request itself; its 401 is readable cross-origin
        denied = httpx.post(f"{s.url}/v1/completions", json=body, headers={"Origin": ORIGIN})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
        other = httpx.options(f"{s.url}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_without_allowed_origins_there_are_no_cors_headers(tmp_path):
    """Also: the chat template files in transformers' order (PR #33957) -- chat_template.jinja, then
    chat_template.json, then tokenizer_config.json's -- served end to end."""
    model = _copy(tmp_path)
    (model / "chat_template.jinja").write_text(MARKED)
    (model / "chat_template.json").write_text(json.dumps({"chat_template": "json {{ messages[0].content }}"}))
    with LiveServer(create_app(ServeConfig(model_path=str(model), served_model_name="demo"))) as s:
        r = httpx.options(f"{s.url}/v1/chat/completions",
                          headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        r = httpx.get(f"{s.url}/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert _chat_ids(s.url) == _encode("[user] Hello!\n")


def test_chat_template_files_in_transformers_order(tmp_path):
    from exl3tools.runtime.text_meta import read_text_meta

    model = _copy(tmp_path)
    assert read_text_meta(model).chat_template.startswith("{{ bos_token }}{% for message")  # tokenizer_config's
    (model / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert read_text_meta(model).chat_template == "json"
    (model / "chat_template.jinja").write_text("jinja")
    assert read_text_meta(model).chat_template == "jinja"
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "t"},
                                                                            {"name": "default", "template": "d"}]}))
    assert read_text_meta(model).chat_template == "d"


def test_hub_and_slicing_carry_chat_template_json():
    from exl3tools.checkpoint.reader import TOKENIZER_FILES
    from exl3tools.hub import SMALL_FILES

    for name in ("chat_template.jinja", "chat_template.json"):
        assert name in SMALL_FILES and name in TOKENIZER_FILES


# ------------------------------------------------------------- --served-model-name x2, --chat-template


def test_several_served_names_and_a_chat_template_override():
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name=("demo", "alias"), chat_template=MARKED)
    with LiveServer(create_app(cfg)) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["demo", "alias"]
        assert client.models.retrieve("alias").id == "alias"
        r = client.completions.create(model="alias", prompt="hi", max_tokens=2)
        assert r.model == "demo"          # vLLM: answers report the first name
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="other", prompt="hi", max_tokens=2)
        assert "'demo', 'alias'" in e.value.body["message"]
        assert httpx.get(f"{s.url}/health").json()["model"] == "demo"
        assert _chat_ids(s.url, model="alias") == _encode("[user] Hello!\n")   # not the checkpoint's template


def test_chat_template_option_reads_a_file_or_inline_jinja(tmp_path):
    from exl3tools.cli.serve import _chat_template

    from exl3tools.errors import UsageError

    f = tmp_path / "t.jinja"
    f.write_text(MARKED)
    assert _chat_template(str(f)) == MARKED
    assert _chat_template(MARKED.replace("\n", "\\n")) == MARKED    # shell-typed escapes, as vLLM
    assert _chat_template("{{ 'é€' }}") == "{{ 'é€' }}"
    with pytest.raises(UsageError, match="not a readable file"):
        _chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(UsageError, match="not a readable file"):
        _chat_template(str(tmp_path))
    with pytest.raises(UsageError, match="not a valid Jinja template"):
        _chat_template("{% for m in messages %}")


@pytest.mark.parametrize("args,text", [
    (["--chat-template", "/nonexistent/t.jinja"], "--chat-template '/nonexistent/t.jinja': not a readable file"),
    (["--chat-template", "{% if %}"], "--chat-template: not a valid Jinja template"),
    (["--allowed-methods", '["GET"]'], "need --allowed-origins"),
    (["--allow-credentials"], "need --allowed-origins"),
    (["--tensor-parallel-size", "0"], "must be at least 1"),
    (["-tp", "0"], "must be at least 1"),
])
def test_bad_vllm_flags_fail_in_one_line(args, text):
    proc = serve(*args, "--port", str(free_port()), "--log-level", "critical")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert text in err and "Traceback" not in err
    if "--chat-template" in args or "need --allowed-origins" in text:
        assert len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ generation_config.json defaults


def _gen_model(tmp_path, **gen) -> object:
    model = _copy(tmp_path, "gen")
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **gen}))
    return model


def _tokens(url: str, **body) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": [1, 50, 60], "ignore_eos": True,
                                                  "return_token_ids": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_generation_config_defaults_repetition_penalty_min_p_and_max_new_tokens(tmp_path, caplog):
    model = _gen_model(tmp_path, repetition_penalty=5.0, min_p=1.0, temperature=1.5, max_new_tokens=6)
    with caplog.at_level("INFO", logger="exl3tools"), \
            LiveServer(create_app(ServeConfig(model_path=str(model), served_model_name="demo"))) as s:
        # said once at load, as vLLM does: the file changes every request that leaves these out
        assert "'repetition_penalty': 5.0" in caplog.text and "--generation-config vllm" in caplog.text
        assert len(_tokens(s.url)) == 6                                    # max_new_tokens: the default
        assert len(_tokens(s.url, max_tokens=9)) == 9                      # ... a request's own wins
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="demo", messages=MSGS, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 6
        greedy = _tokens(s.url, temperature=0, max_tokens=12)
        assert greedy == _tokens(s.url, temperature=0, max_tokens=12, repetition_penalty=5.0)
        assert greedy != _tokens(s.url, temperature=0, max_tokens=12, repetition_penalty=1.0)
        # min_p 1 keeps only the top token: the file's temperature 1.5 then samples the greedy text
        assert all(_tokens(s.url, max_tokens=12, seed=i) == greedy for i in range(3))
        assert any(_tokens(s.url, max_tokens=12, seed=i, min_p=0.0) != greedy for i in range(3))


def test_generation_config_vllm_ignores_the_file(tmp_path):
    model = _gen_model(tmp_path, repetition_penalty=5.0, max_new_tokens=6)
    cfg = ServeConfig(model_path=str(model), served_model_name="demo", generation_config="vllm")
    with LiveServer(create_app(cfg)) as s:
        assert len(_tokens(s.url)) == 16                                   # OpenAI's completions default
        greedy = _tokens(s.url, temperature=0, max_tokens=12)
        assert greedy == _tokens(s.url, temperature=0, max_tokens=12, repetition_penalty=1.0)


# ----------------------------------------------------------------------------- /health's progress


def test_health_reports_load_progress(monkeypatch):
    from exl3tools.runtime import weights

    first, go = threading.Event(), threading.Event()

    def hold(_nbytes, _total):     # the loading thread stops after its first tensor until released
        first.set()
        go.wait(60)

    monkeypatch.setattr(weights, "progress_hook", hold)
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo")
    with LiveServer(create_app(cfg), wait_ready=False) as s:
        try:
            assert first.wait(60)
            h = httpx.get(f"{s.url}/health")
            assert h.status_code == 503 and h.headers["retry-after"] == "1"
            b = h.json()
            assert b["status"] == "loading" and b["tensors_loaded"] == 1
            assert 0 < b["loaded_bytes"] < b["total_bytes"] and 0 < b["fraction"] < 1, b
        finally:
            go.set()
        s.until_ready()
        assert set(httpx.get(f"{s.url}/health").json()) == {"status", "model"}
    assert weights.progress_hook is hold       # the server's hook is gone, the one before it back


# ------------------------------------------------------------------------------ the CLI, restarted


def _run_cli(template, *extra: str) -> tuple[dict, list[list[int]]]:
    """`serve` with the vLLM-named flags (and ``extra``): what it answers, and two unseeded sampled
    requests."""
    port = free_port()
    proc = serve("--port", str(port), "--log-level", "warning", "-tp", "1", "--seed", "5",
                 "--served-model-name", "a", "--served-model-name", "b", "--chat-template", str(template),
                 "--allowed-origins", json.dumps([ORIGIN]), "--api-key", "k", "--generation-config", "vllm", *extra)
    try:
        url = wait_healthy(proc, port)
        seen = {"preflight": httpx.options(f"{url}/v1/completions", headers={
                    "Origin": ORIGIN, "Access-Control-Request-Method": "POST"}).status_code,
                "models": [m["id"] for m in httpx.get(f"{url}/v1/models", headers=KEY).json()["data"]],
                "template": _chat_ids(url, KEY, model="b") == _encode("[user] Hello!\n"),
                "metrics": (httpx.get(f"{url}/metrics").status_code,
                            httpx.get(f"{url}/metrics", headers=KEY).status_code)}
        sampled = []
        for _ in range(2):
            r = httpx.post(f"{url}/v1/completions", headers=KEY, timeout=60, json={
                "model": "b", "prompt": "Once", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.json()["model"] == "a"
            sampled.append(r.json()["choices"][0]["token_ids"])
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err
    return seen, sampled


def test_cli_vllm_flags_and_seed_reproduce_across_restarts(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(MARKED)
    seen, first = _run_cli(template)
    # /metrics is open despite --api-key, as vLLM's
    assert seen == {"preflight": 200, "models": ["a", "b"], "template": True, "metrics": (200, 200)}
    assert first[0] != first[1]            # the server's seed gives each request its own
    seen, again = _run_cli(template, "--metrics-require-key")
    assert again == first                  # ... and the same ones after a restart
    assert seen["metrics"] == (401, 200)   # --metrics-require-key: behind the key
