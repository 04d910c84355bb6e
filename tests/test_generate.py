"""`exl3tools generate` on the demo checkpoint: streaming, sampling options, --logits-out, errors."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner
from exl3tools.cli import main
from safetensors.torch import load_file

from tests.conftest import DEMO

MODEL = DEMO / "model"


def run(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_logits_out_matches_goldens_and_greedy(tmp_path):
    g = load_file(str(DEMO / "goldens_logits.safetensors"))
    ids = ",".join(map(str, g["prompt_p16"].tolist()))
    out = tmp_path / "l.safetensors"
    res = run(MODEL, "--token-ids", ids, "--max-tokens", 3, "--logits-out", out, "--ignore-eos")
    assert res.exit_code == 0, res.output
    t = load_file(str(out))
    assert t["prompt_tokens"].tolist() == g["prompt_p16"].tolist()
    assert t["prompt_logits"].shape == (16, 2048) and t["step_logits"].shape == (3, 2048)
    assert (t["prompt_logits"] - g["exl3_logits_p16"]).abs().max() < 0.01
    assert (t["step_logits"][0] == t["prompt_logits"][-1]).all()
    assert t["tokens"].tolist() == t["step_logits"].argmax(-1).tolist()   # greedy by default


def test_prompt_streams_text_and_json():
    res = run(MODEL, "--prompt", "Hello world", "--max-tokens", 4, "--ignore-eos")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip()
    res = run(MODEL, "--token-ids", "1,5,9", "--max-tokens", 4, "--temperature", 0.9, "--top-p", 0.9,
              "--top-k", 40, "--seed", 11, "--json", "--ignore-eos")
    assert res.exit_code == 0, res.output
    a = json.loads(res.stdout)
    again = json.loads(run(MODEL, "--token-ids", "1,5,9", "--max-tokens", 4, "--temperature", 0.9, "--top-p",
                           0.9, "--top-k", 40, "--seed", 11, "--json", "--ignore-eos").stdout)
    assert a["completion_ids"] == again["completion_ids"] and len(a["completion_ids"]) == 4
    assert a["prompt_ids"] == [1, 5, 9] and isinstance(a["text"], str)


def test_bad_input_one_line_and_exit_codes(tmp_path):
    res = run(MODEL, "--prompt", "x", "--token-ids", "1")
    assert res.exit_code == 2 and "exactly one of" in res.output
    res = run(MODEL, "--token-ids", "1,a")
    assert res.exit_code == 2 and "comma-separated" in res.output
    res = run(tmp_path / "nope", "--token-ids", "1")
    assert res.exit_code == 2
    d = tmp_path / "m"
    shutil.copytree(MODEL, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["RwkvForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    res = run(d, "--token-ids", "1")
    assert res.exit_code == 3 and "RwkvForCausalLM" in res.output
    assert res.output.strip().count("\n") == 0
