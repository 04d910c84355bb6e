"""Tensor parallelism's CUDA paths at TP 2 against TP 1: a rank's fused MoE (``--moe tp`` and
``ep``, the reduced path with kernels/moe_combine.py), an MLA rank's 16-32 heads, the vocab-cut
head's gather, chained decode steps and device-held MTP drafts. On a machine with one GPU
(``one_gpu``: EXL3TOOLS_TP_ONE_GPU=1, both ranks on cuda:0, the model's collectives over gloo,
the fixed-shape step without graphs, since gloo syncs the host); with two GPUs also over NCCL
with CUDA graphs (``nccl``), as `serve --tp 2` runs. Spawns a worker process per runner."""

from __future__ import annotations

import pytest

from tests.conftest import DSV3_DECISIVE, fixture_dir, model_dir

PROMPT = list(range(3, 43))          # 40 tokens: past the glm5 fixtures' index_topk (32)
STEPS = (5, 900, 11)


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(params=["one_gpu", "nccl"])
def tp_mode(request, monkeypatch) -> str:
    """The decode mode a TP 2 runner takes here ("static" over gloo on one GPU, "graphs" over NCCL)."""
    import torch

    if request.param == "one_gpu":
        monkeypatch.setenv("EXL3TOOLS_TP_ONE_GPU", "1")
        return "static"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (NCCL)")
    monkeypatch.delenv("EXL3TOOLS_TP_ONE_GPU", raising=False)
    return "graphs"


def _logits(r) -> list:
    r.add_sequence("s")
    out = [r.step([("s", PROMPT)], all_logits=True).float().cpu()]
    out += [r.step([("s", [t])]).float().cpu() for t in STEPS]
    r.free_sequence("s")
    return out


@pytest.mark.parametrize("name,moe,tol", [("glm4_moe-tp-2.0bpw-mul1", "tp", 1e-2), ("glm4_moe-tp-2.0bpw-mul1", "ep", 1e-2),
                                          ("glm5_moe_dsa-tp-4.0bpw-mcg", "tp", 3e-2), (DSV3_DECISIVE, "ep", 1e-2)])
def test_tp2_gives_tp1s_logits(dev, tp_mode, name, moe, tol, request):
    """The prompt's every row and three decode steps through the fixed-shape step (graphs over
    NCCL): TP 2 against TP 1 within ``tol`` (glm5's DSA selection sits on near-ties of the
    indexer scores, which a rank's summation order may flip: tests/gpu/test_runtime_mla_gpu.py)."""
    from exl3tools.runtime.runner import load_runner

    if dev == "cpu":
        pytest.skip("needs CUDA")
    path = model_dir(name, request) if name.startswith("synth-") else fixture_dir(name) / "model"
    kw = dict(device="cuda", max_cache_tokens=512, block_size=16)
    with load_runner(path, decode="static", **kw) as r:
        want = _logits(r)
    with load_runner(path, tp=2, moe=moe, decode=tp_mode, **kw) as r:
        assert r.decode_mode == tp_mode
        got = _logits(r)
        # a chained step (the worker takes its token by a broadcast) gives the plain step's logits
        import torch

        rows = {}
        for s in ("plain", "chained"):
            r.add_sequence(s)
            r.step([(s, PROMPT[:20])])
            rows[s] = (r.step([(s, [7])]) if s == "plain" else
                       r.step_chained([s], torch.tensor([7], device="cuda"))).float().cpu()
            r.free_sequence(s)
    errs = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errs) < tol, errs
    assert _rel(rows["chained"], rows["plain"]) < 1e-5


@pytest.mark.parametrize("ks", [(3, 3), (3, 1)])
def test_tp2_device_drafts_equal_the_host_round(dev, tp_mode, ks, monkeypatch):
    """At TP 2 on the glm5 TP fixture (MLA + DSA + MTP head): draft_device + verify_device (each
    depth's tokens and the verified drafts broadcast to the worker on the device) against
    draft_many + verify with a host read a depth: the same drafts and verify logits, rows of a
    smaller k padded."""
    from exl3tools.runtime.runner import load_runner

    if dev == "cpu":
        pytest.skip("needs CUDA")
    path = fixture_dir("glm5_moe_dsa-tp-4.0bpw-mcg") / "model"
    K = max(ks)
    out = {}
    for device in (False, True):
        monkeypatch.setenv("EXL3TOOLS_CHAINED_DRAFTS", "1" if device else "0")
        with load_runner(path, tp=2, device="cuda", max_cache_tokens=512, block_size=16, speculative_tokens=3,
                         decode=tp_mode) as r:
            last = {}
            for s, p in ((0, PROMPT), (1, PROMPT[5:17])):
                r.add_sequence(s)
                last[s] = int(r.step([(s, p)])[0].argmax())
            reqs = [(s, last[s], k, None) for s, k in zip(last, ks, strict=True)]
            if device:
                dd = r.draft_device(reqs)
                logits = r.verify_device([(s, last[s]) for s in last], dd)
                assert logits is not None
                drafts = [t[:k] for t, k in zip(dd.tokens.tolist(), ks, strict=True)]
                rows = [logits[i * (K + 1):i * (K + 1) + k + 1].float().cpu() for i, k in enumerate(ks)]
            else:
                drafts = [d for d, _ in r.draft_many(reqs)]
                logits = r.verify([(s, [last[s]] + d) for s, d in zip(last, drafts, strict=True)])
                rows = [x.float().cpu() for x in logits.split([k + 1 for k in ks])]
            out[device] = (drafts, rows)
    assert out[True][0] == out[False][0]
    assert max(_rel(a, b) for a, b in zip(out[True][1], out[False][1], strict=True)) < 1e-3


def test_tp2_kv_budget_is_the_fewest_blocks_of_any_rank(dev, monkeypatch):
    """Without max_cache_tokens every rank measures its own GPU's KV budget and the runner takes
    the fewest (both ranks on cuda:0 here: each measures the other's weights too)."""
    from exl3tools.runtime.runner import load_runner

    if dev == "cpu":
        pytest.skip("needs CUDA")
    import torch

    monkeypatch.setenv("EXL3TOOLS_TP_ONE_GPU", "1")
    path = fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model"
    # a few GiB past what the GPU holds now (other test workers share it): each rank's budget
    free, total = torch.cuda.mem_get_info()
    util = min(1.0, (total - free) / total + 0.1)
    with load_runner(path, tp=2, device="cuda", gpu_memory_utilization=util, max_num_batched_tokens=64,
                     decode="static") as r:
        ranks = r.kv_blocks_by_rank
        assert len(ranks) == 2 and min(ranks) >= 2, ranks
        assert r.blocks.num_blocks == min(ranks)
        r.add_sequence("s")
        assert r.step([("s", PROMPT)]).isfinite().all()
