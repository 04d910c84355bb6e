"""Batch-invariant runs on CUDA (runtime/invariance.py, ``serve --batch-invariant``): a row's result
is the same bit for bit whatever else its launch or step holds. The EXL3 linears (1 to 200 rows:
the gemv kernel up to 64, the shared-memory tile kernel past; long K with many splits) and experts
(slots, tiles on either kernel), the paged decode attention, the whole
decode step on the GQA fixtures (a sequence alone, among others, in prompt buckets, on a
prefix-cache hit), and the server through the openai client: one seeded request's text alone and
among 31 others. Each check also runs without the mode where the default path is known to differ,
so a test that passes is not comparing a path with itself. Skipped without CUDA."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

from tests.conftest import cuda_available
from tests.gpu.conftest import cuda_backend
from tests.gpu.kernel_cases import as_tensors as _tensors
from tests.gpu.kernel_cases import cuda_experts as _experts
from tests.gpu.kernel_cases import random_linear as _lin
from tests.gpu.kernel_cases import rel_err as _rel

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs CUDA")

MODELS = ["glm4_moe-3.0bpw-mcg", "qwen3_moe-2.5bpw-mul1", "llama-4.0bpw-mul1"]


@pytest.fixture
def invariant(monkeypatch):
    monkeypatch.setenv("EXL3TOOLS_BATCH_INVARIANT", "1")


def _same(a, b) -> bool:
    return a.shape == b.shape and bool((a.view(-1) == b.view(-1)).all())


@pytest.mark.parametrize("k,n,width", [(4096, 2176, 48), (256, 640, 24), (1024, 384, 64)])
def test_linear_rows_do_not_depend_on_the_batch(invariant, k, n, width):
    import torch
    from exl3tools.kernels import cuda_exl3 as cx
    from exl3tools.kernels import reference as ref

    rng = np.random.default_rng(k + n)
    tr, suh, svh, b = _lin(rng, k, n, width, bias=True)
    lin = cx.CudaLinear(_tensors(torch, tr, suh, svh, b), "mul1", "cuda")
    assert lin.invariant
    x = torch.from_numpy(rng.normal(0, 1, (200, k)).astype(np.float16)).cuda()
    full = lin(x)
    w = ref.decode_linear(tr, suh, svh, "mul1").astype(np.float64)
    assert _rel(full.float().cpu().numpy(), x.cpu().numpy().astype(np.float64) @ w + b) < 2e-3
    for lo, hi in [(0, 1), (7, 8), (5, 18), (0, 64), (40, 105), (3, 200)]:
        assert _same(lin(x[lo:hi]), full[lo:hi]), (lo, hi)
    for _ in range(3):                  # run to run: fixed-point sums do not depend on arrival order
        assert _same(lin(x[:5]), full[:5])


def test_experts_rows_do_not_depend_on_slots_or_tiles(invariant):
    import torch
    from exl3tools.kernels import cuda_exl3 as cx

    from exl3tools.runtime.layers import expert_tiles

    rng = np.random.default_rng(3)
    E, k, n = 6, 1024, 384
    ex = _experts([_tensors(torch, *_lin(rng, k, n, 40, bias=True)) for _ in range(E)], "mcg", "cuda")
    assert ex.invariant and not ex.fused_out
    assert ex._tile_kernel(64) == cx.TILE_KERNELS[64]          # 64-row tiles: the shared-memory kernel
    T, top = 90, 3
    x = torch.from_numpy(rng.normal(0, 1, (T, k)).astype(np.float16)).cuda()
    sel = torch.from_numpy(np.stack([rng.choice(E, top, replace=False) for _ in range(T)]).reshape(-1)).cuda()
    tok = torch.arange(T, device="cuda").repeat_interleave(top)
    slots = ex.slots(x, tok, sel)
    for lo, hi in [(0, 1), (10, 13), (0, 270), (100, 131)]:
        assert _same(ex.slots(x, tok[lo:hi], sel[lo:hi]), slots[lo:hi]), (lo, hi)
    for rows in (8, 64):                # the same pairs through expert-sorted tiles of 8 and 64 rows
        # (the gemv kernel, then the shared-memory tile kernel)
        tile_exp, row_exp, slot, valid = expert_tiles(sel, E, rows)
        y = ex.tiles(x, torch.where(valid, slot, 0) // top, row_exp, tile_exp, rows)
        assert _same(y[valid], slots[slot[valid]]), rows


def test_paged_attention_rows_do_not_depend_on_the_batch():
    import torch
    from exl3tools.kernels import paged_attention as pa

    torch.manual_seed(0)
    B, nq, nkv, D, bs, width = 12, 16, 4, 128, 16, 256       # tables of 4096 tokens
    k = torch.randn(B * width + 1, bs, nkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, nq, D, device="cuda")
    tables = torch.randperm(B * width, device="cuda", dtype=torch.int32)[:B * width].view(B, width) + 1
    lens = torch.tensor([1, 70, 4096, 900, 2048, 33, 3000, 64, 65, 1500, 4000, 7], device="cuda", dtype=torch.int32)
    splits, tiles = pa.invariant_splits(width * bs, D, k.dtype)
    assert splits > 1
    run = lambda i, j, **kw: pa.paged_decode(q[i:j], k, v, tables[i:j], lens[i:j], 0.088, **kw)  # noqa: E731
    full = run(0, B, num_splits=splits, min_split_tiles=tiles)
    ref = pa.paged_decode_reference(q, k, v, tables, lens, 0.088)
    assert (full - ref).abs().max() < 2e-2
    for i in range(B):
        assert _same(run(i, i + 1, num_splits=splits, min_split_tiles=tiles), full[i:i + 1]), i
    # the default splits follow the batch: a lone long row splits otherwise than among 12
    dflt = run(0, B)
    assert any(not _same(run(i, i + 1), dflt[i:i + 1]) for i in range(B))


def _runner(path, **kw):
    """The fixture's Runner as the step tests load it (bf16 KV, 16 sequences, 8192 cache tokens)."""
    from exl3tools.runtime.runner import load_runner

    return load_runner(path, device="cuda", backend=cuda_backend(), max_context=256, max_num_seqs=16,
                       block_size=16, kv_dtype="bf16", max_cache_tokens=8192, **kw)


def _step_logits(runner, plan):
    """Run ``plan`` (per step: [(seq, tokens)]) and return {seq: [logits of each step it was in]}."""
    out: dict = {}
    for step in plan:
        for s, _ in step:
            if s not in runner._seqs:
                runner.add_sequence(s)
        logits = runner.step(step)
        for (s, _), row in zip(step, logits, strict=True):
            out.setdefault(s, []).append(row.clone())
    return out


@pytest.mark.parametrize("name", MODELS)
def test_decode_step_rows_do_not_depend_on_the_batch(name, invariant, monkeypatch):
    """One sequence's logits, step by step, alone and among up to 11 others (their prompts in
    prompt buckets beside its decode rows, bucket sizes 1 to 96; the MoE's pairs in slots alone,
    in expert-sorted tiles among the others): equal bit for bit; then a prefix-cache hit equals
    the cold run. Without the mode the same schedule differs (the next test)."""
    import torch

    from exl3tools.runtime import fused_step
    from tests.conftest import fixture_dir

    tiled = []
    real = fused_step._pairs_by_tiles
    monkeypatch.setattr(fused_step, "_pairs_by_tiles", lambda *a: tiled.append(1) or real(*a))

    path = fixture_dir(name) / "model"
    prompt = list(range(3, 40))
    solo = [[("A", prompt)]] + [[("A", [7 + i])] for i in range(6)]
    others = [(f"o{j}", list(range(10 + j, 12 + 2 * j))) for j in range(11)]      # 2 to 12 tokens
    crowd = ([[("A", prompt), *others[:3]]] +
             [[("A", [7])], [("A", [8]), *others[3:]]] +
             [[("A", [9 + i])] + [(f"o{j}", [5 + i]) for j in range(11)] for i in range(4)])

    def runs():
        r = _runner(path, max_num_batched_tokens=96)
        a = _step_logits(r, solo)["A"]
        r.free_sequence("A")
        for s in list(r._seqs):
            r.free_sequence(s)
        b = _step_logits(r, [[("A2", prompt)]] + [[("A2", [7 + i])] for i in range(6)])["A2"]   # a hit
        r.close()
        r = _runner(path, max_num_batched_tokens=96)
        c = _step_logits(r, crowd)["A"]
        paths = r.last_path
        r.close()
        return a, b, c, paths

    a, hit, c, last = runs()
    assert last == "decode"
    assert bool(tiled) == (name != "llama-4.0bpw-mul1")      # the wide steps' MoE took the tiles
    for i, (x, y, z) in enumerate(zip(a, hit, c, strict=True)):
        assert _same(x, y), ("prefix hit", i)
        assert _same(x, z), ("among others", i)
    assert torch.isfinite(torch.stack(a)).all()


def test_without_the_mode_the_crowd_differs(monkeypatch):
    """The control: the same comparison as above without the mode finds a difference (kernel
    splits by batch, atomics), so the equalities above are not vacuous."""
    from tests.conftest import fixture_dir

    monkeypatch.delenv("EXL3TOOLS_BATCH_INVARIANT", raising=False)
    path = fixture_dir("glm4_moe-3.0bpw-mcg") / "model"
    prompt = list(range(3, 40))
    got = []
    for extra in (0, 15):
        r = _runner(path)
        plan = [[("A", prompt)]] + [[("A", [7 + i])] + [(f"o{j}", [3 + j]) for j in range(extra)] for i in range(4)]
        got.append(_step_logits(r, plan)["A"])
        r.close()
    assert any(not _same(x, y) for x, y in zip(*got, strict=True))


def test_serve_batch_invariant_seeded_text_alone_and_among_31(monkeypatch):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from exl3tools.runtime import invariance
    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer
    from tests.conftest import fixture_dir

    monkeypatch.setenv(invariance.VARIABLE, "1")      # what serve --batch-invariant sets
    path = fixture_dir("glm4_moe-3.0bpw-mcg") / "model"
    app = create_app(ServeConfig(model_path=str(path), served_model_name="m", device="cuda", backend=cuda_backend(),
                                 max_batch=32, max_context=512, max_cache_tokens=32768,
                                 max_prefill_tokens=invariance.cap_prefill_tokens(2048, 32)))
    with LiveServer(app) as s:
        runner = app.state.server.engine.runner
        assert runner.invariant and runner.paged.decoder.prompt_buckets
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=300)
        kw = dict(model="m", max_tokens=48, extra_body={"ignore_eos": True}, logprobs=1)
        seeded = dict(prompt=[3, 17, 99, 4, 250, 11, 7], temperature=0.9, top_p=0.95, seed=1234, **kw)
        alone = client.completions.create(**seeded).choices[0]
        with cf.ThreadPoolExecutor(32) as pool:
            futs = [pool.submit(client.completions.create, prompt=[5 + i] * (3 + i), temperature=0.9, seed=i, **kw)
                    for i in range(16)]
            futs.insert(8, pool.submit(client.completions.create, **seeded))
            futs += [pool.submit(client.completions.create, prompt=[9 + i] * (2 + i), temperature=0.9, seed=i, **kw)
                     for i in range(15)]
            crowd = [f.result() for f in futs]
        assert all(r.usage.completion_tokens == 48 for r in crowd)
        among = crowd[8].choices[0]
        assert among.text == alone.text
        assert among.logprobs.token_logprobs == alone.logprobs.token_logprobs
        assert runner.last_path != "eager"
