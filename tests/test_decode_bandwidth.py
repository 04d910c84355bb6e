"""Weight bytes a decode step reads (exl3tools/roofline.py) and the achieved-GB/s metrics of serve."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from exl3tools.checkpoint import Checkpoint
from exl3tools.roofline import DecodeReads, decode_reads, reads_of
from tests.conftest import DEMO

MODEL_DIR = DEMO / "model"
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I16": 2, "U8": 1, "I8": 1}


def _expected(batch: int) -> float:
    """By hand from the safetensors header: every tensor once, except the embedding table, layers
    >= num_hidden_layers (MTP) and routed experts, of which E(1 - (1 - k/E)^B) per layer."""
    from safetensors import safe_open

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    n_layers, E, k = cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    fixed = experts = 0
    with safe_open(str(MODEL_DIR / "model.safetensors"), "np") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            nbytes = _DTYPE_BYTES[sl.get_dtype()]
            for d in sl.get_shape():
                nbytes *= d
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if name.startswith("model.embed_tokens.") or (m and int(m.group(1)) >= n_layers):
                continue
            if re.match(r"model\.layers\.\d+\.mlp\.experts\.\d+\.", name):
                experts += nbytes
            else:
                fixed += nbytes
    assert fixed and experts
    return fixed + experts * (1 - (1 - k / E) ** batch)


@pytest.mark.parametrize("batch", [1, 8, 4096])
def test_bytes_match_the_headers(batch):
    got = decode_reads(Checkpoint.open(MODEL_DIR)).bytes_for(batch)
    assert got == pytest.approx(_expected(batch), abs=1)


def test_large_batches_read_every_expert_and_small_ones_k():
    r = decode_reads(Checkpoint.open(MODEL_DIR))
    assert (r.experts, r.top_k) == (16, 4)
    assert r.distinct_experts(1) == pytest.approx(4)
    assert r.bytes_for(4096) == r.fixed_bytes + round(16 * r.per_expert_bytes)
    assert r.bytes_for(1) < r.bytes_for(8) < r.bytes_for(4096)
    # serving-expectations.md §8's worked counts: GLM-4.5 (E 160, k 8), DeepSeek-V3 (E 256, k 8)
    assert [round(DecodeReads(0, 1.0, 160, 8).distinct_experts(b)) for b in (1, 8, 32)] == [8, 54, 129]
    assert [round(DecodeReads(0, 1.0, 256, 8).distinct_experts(b)) for b in (1, 8, 32)] == [8, 57, 163]


def test_expert_parallel_rank_reads_its_share():
    ck = Checkpoint.open(MODEL_DIR)
    one, ep2 = decode_reads(ck), decode_reads(ck, tp=2, moe="ep")
    assert ep2.per_expert_bytes == pytest.approx(one.per_expert_bytes / 2)   # half the experts, whole
    assert ep2.fixed_bytes < one.fixed_bytes                                 # attention cut too


def test_tied_embeddings_count_as_the_head_and_mtp_is_left_out():
    cfg = {"num_hidden_layers": 1, "n_routed_experts": 2, "num_experts_per_tok": 1}
    tensors = [("model.embed_tokens.weight", 1000), ("model.layers.0.self_attn.q_proj.trellis", 10),
               ("model.layers.0.mlp.experts.0.up_proj.trellis", 6), ("model.layers.0.mlp.experts.1.up_proj.trellis", 6),
               ("model.layers.1.self_attn.q_proj.trellis", 77), ("model.norm.weight", 2)]
    assert reads_of(tensors, cfg) == DecodeReads(1012, 6.0, 2, 1)
    assert reads_of([*tensors, ("lm_head.trellis", 50)], cfg).bytes_for(1) == 10 + 2 + 50 + 6
    assert reads_of(tensors, {"num_hidden_layers": 1}).bytes_for(1) == 1024   # dense: experts all read


def test_roofline_is_torch_free():
    code = (f"from exl3tools.roofline import decode_reads\nfrom exl3tools.checkpoint import Checkpoint\n"
            f"decode_reads(Checkpoint.open({str(MODEL_DIR)!r}), tp=2, moe='ep')\n"
            "import sys; print(' '.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" not in out.stdout.split()


def test_engine_counts_decode_only_steps():
    from exl3tools.server.engine import Engine

    eng = Engine(lambda: None)
    eng.decode_reads = DecodeReads(1_000_000, 1000.0, 16, 4)
    eng._note_bandwidth({"path": "eager", "seqs": 2, "rows": 40, "prefill": 1, "ms": 5.0})   # a prompt
    assert eng.decode_gbps() == 0.0 and eng.decode_bytes == 0
    for ms in (1.0, 2.0, 100.0):
        eng._note_bandwidth({"path": "chained", "seqs": 1, "rows": 1, "ms": ms})
    assert eng.decode_bytes == 1_004_000
    assert eng.decode_gbps() == pytest.approx(1_004_000 / 2e-3 / 1e9)   # the median step
    assert eng.stats()["decode_weight_read_gbps"] == pytest.approx(0.502)


# ----------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer

    app = create_app(ServeConfig(model_path=str(MODEL_DIR), served_model_name="demo", max_context=256))
    with LiveServer(app) as s:
        yield s


def _stream(url: str) -> int:
    body = {"model": "demo", "prompt": "The capital of France is", "max_tokens": 12, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return sum(1 for line in r.iter_lines() if line.startswith("data: {"))


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_metrics_and_stats_report_decode_bandwidth(server):
    with ThreadPoolExecutor(3) as pool:     # several streams: decode steps of more than one sequence
        assert all(n > 0 for n in pool.map(_stream, [server.url] * 3))
    text = httpx.get(f"{server.url}/metrics").text
    assert "uniform-routing" in text and "KV-cache reads not included" in text
    nbytes = _gauge(text, "exl3tools_decode_weight_read_bytes")
    assert _gauge(text, "exl3tools_decode_weight_read_gbps") > 0
    reads = decode_reads(Checkpoint.open(MODEL_DIR))
    assert nbytes in {reads.bytes_for(b) for b in (1, 2, 3)}
    stats = httpx.get(f"{server.url}/v1/engine/stats").json()
    assert stats["decode_weight_read_gbps"] > 0
    assert stats["decode_weight_read_bytes"] in {reads.bytes_for(b) for b in (1, 2, 3)}


def test_runner_takes_the_reads_from_the_headers_it_loaded(monkeypatch):
    """The estimate comes from the checkpoint the load opened: the server's ready step no longer
    parses every shard header of a large checkpoint a second time."""
    from exl3tools.runtime.runner import load_runner

    want = decode_reads(Checkpoint.open(MODEL_DIR))
    runner = load_runner(MODEL_DIR, backend="reference", device="cpu")
    try:
        def no_open(*a, **k):
            raise AssertionError("headers re-read")

        monkeypatch.setattr(Checkpoint, "open", no_open)
        assert runner.decode_reads() == want
    finally:
        runner.close()
