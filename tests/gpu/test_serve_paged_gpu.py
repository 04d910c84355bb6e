"""The paged engine on the GPU (backend "cuda", bf16/fp32 paged KV cache, CUDA graphs per batch
bucket, Triton paged attention) against the CPU reference over the interleaved continuous-batching
schedule of tests/test_paged_runner.py; `serve` on CUDA through the openai client: graphs by
default, prefix-cache hits, the same seeded text alone and among 32 concurrent streams.
Skipped without CUDA."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json

import pytest

from tests.conftest import cuda_available
from tests.gpu.conftest import cuda_backend

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs CUDA")

NAMES = ["glm4_moe-3.0bpw-mcg", "llama-4.0bpw-mul1", "qwen3_moe-2.5bpw-mul1"]
REL = {"fp32": 1e-2, "bf16": 3e-2}     # fp16 kernels (and a bf16 cache) vs the fp32 reference


def _rel(a, b) -> float:
    return ((a.float().cpu() - b.float().cpu()).abs().max() / b.float().cpu().abs().max()).item()


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_paged_graph_runner_on_cuda_matches_cpu_reference(name, kv):
    import torch

    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.test_paged_runner import Reference, schedule

    path = fixture_dir(name) / "model"
    backend = cuda_backend()
    ref_runner = load_runner(path, max_context=48)
    ref = schedule(Reference(ref_runner.model))
    runner = load_runner(path, device="cuda", backend=backend, max_context=48, max_num_seqs=3, block_size=4,
                         kv_dtype=kv, max_cache_tokens=4096)
    assert runner.decode_mode == "graphs"
    got = schedule(runner)
    assert runner.paged.decoder._graphs                # decode steps replayed captured graphs
    for s, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.shape == r.shape and g.dtype == torch.float32 and g.device.type == "cpu", s
        assert _rel(g, r) < REL[kv], (name, kv, s, _rel(g, r))
    runner.close()


@pytest.mark.parametrize("name", ["glm4_moe-3.0bpw-mcg", "qwen3_moe-2.5bpw-mul1"])
def test_short_prompts_replay_the_decode_graphs(name, monkeypatch):
    """Steps of <= max_num_seqs new tokens (a prompt, a prompt beside a decode) replay the decode
    graphs, one row per token, and match the CPU reference."""
    import torch

    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.test_paged_runner import A, B, Reference

    path = fixture_dir(name) / "model"
    ref = Reference(load_runner(path, max_context=48).model)
    monkeypatch.setenv("EXL3TOOLS_ROW_STEPS", "1")       # a preview path on CUDA (runtime/preview.py)
    r = load_runner(path, device="cuda", backend=cuda_backend(), max_context=48, max_num_seqs=8, block_size=4,
                    kv_dtype="bf16", max_cache_tokens=4096)
    assert r.decode_mode == "graphs" and r._row_steps
    monkeypatch.setattr(r.paged, "forward", lambda *a, **k: pytest.fail("eager forward for <= 8 rows"))
    for x in (r, ref):
        x.add_sequence("A")
    got, want = r.step([("A", A)], all_logits=True), ref.step([("A", A)], all_logits=True)
    assert got.shape == want.shape and got.dtype == torch.float32 and _rel(got, want) < REL["bf16"]
    for x in (r, ref):
        x.add_sequence("B")
    assert _rel(r.step([("A", [5]), ("B", B)]), ref.step([("A", [5]), ("B", B)])) < REL["bf16"]
    for t in (6, 7):
        assert _rel(r.step([("A", [t]), ("B", [t])]), ref.step([("A", [t]), ("B", [t])])) < REL["bf16"]
    r.close()


@pytest.mark.parametrize("shared", ["0", "1"])
@pytest.mark.parametrize("name", ["glm4_moe-3.0bpw-mcg", "deepseek_v3-3.0bpw-3inst", "glm5_moe_dsa-3.0bpw-mul1"])
def test_prompt_steps_replay_prompt_graphs(name, shared, monkeypatch):
    """The prompt_graphs preview on CUDA: steps past the decode buckets (short prompts beside a
    decoding sequence) replay the prompt buckets' graphs, never the eager forward, and match the
    CPU reference, DSA's sparse variant too; the graphs were captured at load, into one graph pool
    with the decode graphs' (EXL3TOOLS_SHARED_GRAPH_POOL) or a pool of their own."""
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.test_paged_runner import A, B, C, Reference

    path = fixture_dir(name) / "model"
    ref = Reference(load_runner(path, max_context=48).model)
    monkeypatch.setenv("EXL3TOOLS_PROMPT_GRAPHS", "1")
    monkeypatch.setenv("EXL3TOOLS_SHARED_GRAPH_POOL", shared)
    r = load_runner(path, device="cuda", backend=cuda_backend(), max_context=48, max_num_seqs=2, block_size=4,
                    kv_dtype="bf16", max_cache_tokens=4096, max_num_batched_tokens=30)
    d = r.paged.decoder
    assert r.decode_mode == "graphs" and d.prompt_buckets == [4, 8, 16, 24, 32]
    assert set(d._pools) == ({"decode"} if shared == "1" else {"decode", "prompt"})
    assert {k[-3] for k in d._graphs if k[-3] > d.max_rows} == set(d.prompt_buckets)
    monkeypatch.setattr(r.paged, "forward", lambda *a, **k: pytest.fail("eager forward for a prompt step"))
    for x in (r, ref):
        x.add_sequence("A")
    assert _rel(r.step([("A", A)]), ref.step([("A", A)])) < REL["bf16"] and r.last_path == "prompt"
    for x in (r, ref):
        x.add_sequence("B")
    assert _rel(r.step([("A", [5]), ("B", B + C)]), ref.step([("A", [5]), ("B", B + C)])) < REL["bf16"]
    assert r.last_path == "prompt" and d.last_key == (16, False, d.max_blocks)
    for t in (6, 7):
        assert _rel(r.step([("A", [t]), ("B", [t])]), ref.step([("A", [t]), ("B", [t])])) < REL["bf16"]
        assert r.last_path == "decode"
    if d.dsa_topk is not None:          # glm5 (index_topk 32): A's new rows reach 36, so the step selects
        batch = [("A", list(range(40, 66))), ("B", [8])]
        assert _rel(r.step(batch), ref.step(batch)) < REL["bf16"]
        assert r.last_path == "prompt" and d.last_key[:2] == (32, True)
    r.close()


@pytest.mark.parametrize("name", NAMES)
def test_long_steps_on_cuda_match_cpu_reference(name, monkeypatch):
    """Long steps on CUDA (EXL3TOOLS_LONG_STEPS, the default there): steps past the prompt buckets (a prompt chunk alone, beside
    decoding rows, after cached tokens) run PagedDecoder.long_step, never the eager forward, and
    match the CPU reference; every row's logits still take the eager forward."""
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.test_paged_runner import A, B, C, Lockstep, Reference

    path = fixture_dir(name) / "model"
    ref = Reference(load_runner(path, max_context=48).model)
    monkeypatch.setenv("EXL3TOOLS_LONG_STEPS", "1")
    r = load_runner(path, device="cuda", backend=cuda_backend(), max_context=48, max_num_seqs=2, block_size=4,
                    kv_dtype="bf16", max_cache_tokens=4096, max_num_batched_tokens=6)
    d = r.paged.decoder
    assert r.decode_mode == "graphs" and d.long_steps and d.prompt_buckets == [4, 8]
    assert d.long_buckets == []          # no planned step passes 8 rows: no long-step graphs, eager long steps
    eager, forward = [], r.paged.forward
    monkeypatch.setattr(r.paged, "forward", lambda *a, **k: eager.append(1) or forward(*a, **k))
    ls = Lockstep(r, ref, REL["bf16"])
    ls.add("A")
    assert ls.step([("A", A + C)]) == "long"                         # 18 rows alone
    ls.add("B")
    assert ls.step([("A", [5]), ("B", B + C)]) == "long"             # beside a decoding row
    assert ls.step([("B", C), ("A", [6])]) == "long"                 # after B's 14 cached tokens
    assert ls.step([("A", [7]), ("B", [8])]) == "decode" and not eager
    ls.free("B")
    ls.add("D")
    assert ls.step([("D", C + B)], all_logits=True) == "eager" and eager == [1]
    r.close()


@pytest.mark.parametrize("name", NAMES)
def test_long_graphs_on_cuda_match_cpu_reference(name, monkeypatch):
    """Long-step graphs (the default on CUDA): long steps of up to a bucket of rows and
    ``long_seqs`` sequences replay a graph captured with the prompt buckets (the prefill kernel on
    a fixed grid of row tiles, rows padded to the bucket) and match the CPU reference, replay after
    replay; a step of more rows than the largest bucket takes the eager long step."""
    import exl3tools.runtime.long_steps as P
    import exl3tools.runtime.runner as R
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.test_paged_runner import A, B, C, Lockstep, Reference

    path = fixture_dir(name) / "model"
    ref = Reference(load_runner(path, max_context=64).model)
    monkeypatch.setattr(P, "LONG_GRAPH_ROWS", (16, 32))
    monkeypatch.setattr(P, "LONG_GRAPH_MAX_ROWS", 32)       # no bucket that fits the largest planned step
    monkeypatch.setattr(R, "PROMPT_GRAPH_ROWS", 8)          # prompt buckets 4, 8; planned steps up to 66 rows
    monkeypatch.delenv("EXL3TOOLS_LONG_STEPS", raising=False)
    monkeypatch.delenv("EXL3TOOLS_LONG_GRAPHS", raising=False)
    r = load_runner(path, device="cuda", backend=cuda_backend(), max_context=64, max_num_seqs=2, block_size=4,
                    kv_dtype="bf16", max_cache_tokens=4096, max_num_batched_tokens=64)
    d = r.paged.decoder
    assert r.decode_mode == "graphs" and d.long_buckets == [16, 32]
    assert {k[1] for k in d._graphs if k[0] == "long"} == {16, 32}        # captured at start
    padded = []
    real = d._long_padded
    monkeypatch.setattr(d, "_long_padded", lambda R_, *a: padded.append((R_, len(a[0]))) or real(R_, *a))
    ls = Lockstep(r, ref, REL["bf16"])
    ls.add("A")
    assert ls.step([("A", A + C)]) == "long"                         # 18 rows: bucket 32
    ls.add("B")
    assert ls.step([("A", [5]), ("B", B + C)]) == "long"             # 15 rows, two sequences: bucket 16
    assert ls.step([("B", C), ("A", [6])]) == "long"                 # 12 rows after B's cached 14
    assert ls.step([("A", [7]), ("B", [8])]) == "decode"
    ls.free("B")
    ls.add("D")
    assert ls.step([("D", C + B + A + C + B)]) == "long"             # 35 rows: past the buckets, eagerly
    assert padded == [(32, 18), (16, 15), (16, 12)], padded
    assert d._long_out[1].shape[0] == 32            # one set of outputs, every bucket's graph writes it
    r.close()


def test_paged_decode_triton_matches_reference_in_the_model():
    """The decode step with the Triton kernel vs the same step with the torch reference kernel."""
    import torch
    from exl3tools.kernels import paged_attention

    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir

    path = fixture_dir("glm4_moe-3.0bpw-mcg") / "model"
    outs = []
    for fn in (paged_attention.paged_decode, paged_attention.paged_decode_reference):
        r = load_runner(path, device="cuda", backend=cuda_backend(), max_context=256, max_num_seqs=4,
                        decode="static", kv_dtype="bf16", max_cache_tokens=4096)
        r.paged.decoder._attend = fn
        for i in range(3):
            r.add_sequence(i)
            r.step([(i, list(range(5 + 40 * i, 45 + 70 * i)))])
        outs.append(torch.cat([r.step([(i, [7 + i]) for i in range(3)]) for _ in range(4)]))
        r.close()
    assert _rel(outs[0], outs[1]) < 1e-3


def test_serve_on_cuda_graphs_prefix_cache_and_seeded_streams():
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer
    from tests.conftest import DEMO

    backend = cuda_backend()
    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", device="cuda",
                                 backend=backend, max_batch=32, max_context=1024, max_cache_tokens=32768))
    with LiveServer(app) as s:
        runner = app.state.server.engine.runner
        assert runner.decode_mode == "graphs" and runner.paged.decoder._graphs
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="demo", max_tokens=16, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in client.completions.create(
            prompt="The capital of France is", temperature=0, stream=True, **kw) if c.choices)
        assert text
        long = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)
        client.completions.create(prompt=long, temperature=0, **kw)    # fills the prefix cache
        again = client.completions.create(prompt=long, temperature=0, **kw)
        assert again.usage.prompt_tokens_details.cached_tokens >= 64 and again.usage.completion_tokens == 16
        # one seeded request alone, then the same request among 31 others
        seeded = dict(prompt="Once upon a time", temperature=0.8, top_p=0.95, seed=1234, **kw)
        alone = client.completions.create(**seeded).choices[0].text
        with cf.ThreadPoolExecutor(32) as pool:
            futs = [pool.submit(client.completions.create, **seeded)]
            futs += [pool.submit(client.completions.create, prompt=f"Story {i}:", temperature=0.8, seed=i, **kw)
                     for i in range(31)]
            crowd = [f.result() for f in futs]
        assert all(r.usage.completion_tokens == 16 for r in crowd)
        # not bit-identical: a batch of 32 runs other kernel splits than a batch of 1, and a random
        # model's near-flat logits can flip a late draw (H200: the 16th token differed); the seeded
        # draws must agree on a long prefix
        a, b = crowd[0].choices[0].text, alone
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common >= min(len(a), len(b)) // 2, (a, b)
        # structured outputs: the grammar's mask applied on the device, beside 7 plain streams
        if importlib.util.find_spec("llguidance") is not None:
            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                      "additionalProperties": False}
            fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
            with cf.ThreadPoolExecutor(8) as pool:
                futs = [pool.submit(client.chat.completions.create, model="demo", max_tokens=32, temperature=0.8,
                                    seed=i, messages=[{"role": "user", "content": f"q{i}"}], response_format=fmt)
                        for i in range(4)]
                futs += [pool.submit(client.completions.create, prompt=f"Story {i}:", temperature=0.8, seed=i, **kw)
                         for i in range(4)]
                answers = [f.result() for f in futs[:4]]
            assert all(json.loads(a.choices[0].message.content).keys() == {"ok"} for a in answers), answers
        assert runner.cache_tokens_used() == 0


def test_a_failed_capture_on_cuda_decodes_eagerly(monkeypatch, caplog):
    """A capture that fails half-way on the GPU (out of memory at bucket 2, after the larger ones
    were captured) leaves a runner that decodes eagerly on the same device, says so, and matches
    the CPU reference: the CUDA state after the aborted capture is usable."""
    import torch

    from exl3tools.runtime import paged_decode
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir
    from tests.test_paged_runner import Reference, schedule

    real = paged_decode.PagedDecoder._body

    def body(self, bs, width=None, sparse=True):
        if bs == 2 and torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError("CUDA out of memory (injected while capturing bucket 2)")
        return real(self, bs, width, sparse)

    monkeypatch.setattr(paged_decode.PagedDecoder, "_body", body)
    name = "llama-4.0bpw-mul1"
    path = fixture_dir(name) / "model"
    ref = schedule(Reference(load_runner(path, max_context=48).model))
    with caplog.at_level("WARNING", logger="exl3tools"):
        runner = load_runner(path, device="cuda", backend=cuda_backend(), max_context=48, max_num_seqs=3,
                             block_size=4, kv_dtype="fp32", max_cache_tokens=4096)
    assert runner.decode_mode == "eager" and runner.paged.decoder is None
    assert any("CUDA graph capture failed" in m for m in caplog.messages), caplog.messages
    for s, (g, r) in enumerate(zip(schedule(runner), ref, strict=True)):
        assert _rel(g, r) < REL["fp32"], (s, _rel(g, r))
    runner.close()


@pytest.mark.parametrize("temps", [[0.0, 0.0], [0.8, 0.0]], ids=["greedy", "sampled"])
def test_a_chained_decode_step_and_its_sampling_never_synchronise(temps):
    """The engine's steady loop (Runner.step_chained, then sample_batch_device and DeviceTokens)
    launches step N + 1 before reading step N's tokens; a host synchronisation anywhere in it
    would stall the host behind the GPU and lose that overlap. Under torch's sync debug mode
    "error" a second chained step (its graph captured by the first) and its sampling, greedy and
    sampled rows, raise nothing."""
    import torch

    from exl3tools.runtime.runner import load_runner
    from exl3tools.runtime.sampling import DeviceTokens, make_generator, sample_batch_device
    from tests.conftest import fixture_dir

    runner = load_runner(fixture_dir("glm4_moe-3.0bpw-mcg") / "model", device="cuda", backend=cuda_backend(),
                         max_context=64, max_num_seqs=2, block_size=4, max_cache_tokens=256)
    assert runner.can_chain
    for s in (0, 1):
        runner.add_sequence(s)
        runner.step([(s, [3, 4, 5])])
    gens = [make_generator(1, device="cuda"), make_generator(2, device="cuda")]

    def step(tokens: torch.Tensor) -> DeviceTokens:
        logits = runner.step_chained([0, 1], tokens)
        return DeviceTokens(sample_batch_device(logits, temps, [0, 0], [0.9, 1.0], gens))

    first = step(torch.tensor([7, 9], device="cuda"))           # captures, warms the allocators
    runner.commit_tokens([(0, 7), (1, 9)])
    torch.cuda.synchronize()
    # the decoder's one intended wait (its pinned inputs' previous copy: the host at most a step
    # ahead) is on an event already complete here; left out so that only unintended syncs raise
    decoder, copied = runner.paged.decoder, runner.paged.decoder._copied
    decoder._copied = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = step(first.rows())
    finally:
        torch.cuda.set_sync_debug_mode("default")
        decoder._copied = copied
    runner.commit_tokens(list(zip([0, 1], first.tolist(), strict=True)))
    assert all(0 <= t < 2048 for t in second.tolist())
    runner.close()
