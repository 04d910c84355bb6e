"""Runner.bos_token / eos_token text, and the server's chat template printing it."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from exl3tools.runtime.runner import load_runner
from tests.conftest import DEMO


def _copy(tmp_path, name="model", **tcfg_changes):
    dst = tmp_path / name
    shutil.copytree(DEMO / "model", dst)
    p = dst / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    for k, v in tcfg_changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))
    return dst


def test_runner_exposes_bos_and_eos_text(tmp_path):
    with load_runner(str(DEMO / "model")) as r:
        assert (r.bos_token, r.eos_token) == ("<s>", "</s>")
    # the tokenizer_config's eos, even where a smaller EOS id exists (config.json's 2)
    m = _copy(tmp_path, "a", eos_token={"content": "<|user|>", "special": True}, bos_token="<|system|>")
    with load_runner(str(m)) as r:
        assert (r.bos_token, r.eos_token) == ("<|system|>", "<|user|>") and r.eos_token_ids == {2, 4}
    # absent there: special_tokens_map.json, then the tokenizer's text for config.json's ids
    m = _copy(tmp_path, "b", eos_token=..., bos_token=...)
    (m / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|assistant|>"}}))
    with load_runner(str(m)) as r:
        assert (r.bos_token, r.eos_token) == ("<s>", "<|assistant|>")
    # an explicit null means none (as HF: the template prints nothing)
    m = _copy(tmp_path, "c", bos_token=None)
    with load_runner(str(m)) as r:
        assert r.bos_token is None and r.eos_token == "</s>"


def test_chat_template_prints_the_runner_eos_token(tmp_path):
    """The server renders eos_token as Runner.eos_token ("<|user|>" here), not as the text of the
    smallest EOS id (config.json's 2, "</s>")."""
    pytest.importorskip("fastapi")
    from tokenizers import Tokenizer

    from exl3tools.server.app import ServeConfig, create_app, runtime_loader
    from exl3tools.server.template import ChatTemplate
    from exl3tools.server.testing import LiveServer

    m = _copy(tmp_path, eos_token="<|user|>", bos_token=None)
    tok = Tokenizer.from_file(str(m / "tokenizer.json"))
    src = json.loads((m / "tokenizer_config.json").read_text())["chat_template"]
    msgs = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"}]
    want = tok.encode(ChatTemplate(src, bos_token="", eos_token="<|user|>").render(msgs),
                      add_special_tokens=False).ids
    assert 4 in want and 2 not in want and 1 not in want
    cfg = ServeConfig(model_path=str(m), served_model_name="demo")
    base = runtime_loader(cfg)
    prompts: list[list[int]] = []

    def load():
        runner = base()
        step = runner.step

        def recording(batch, **kw):
            prompts.extend(list(toks) for _, toks in batch if len(toks) > 1)
            return step(batch, **kw)

        runner.step = recording
        return runner

    with LiveServer(create_app(cfg, load=load)) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={
            "model": "demo", "messages": msgs, "max_tokens": 1, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
    assert prompts == [want]
