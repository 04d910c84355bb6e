"""MLA/DSA runtime on the GPU (Triton kernels) gives the CPU reference runtime's logits; MTP stays exact."""

from __future__ import annotations

import pytest

MLA = ["deepseek_v3-3.0bpw-3inst", "glm5_moe_dsa-3.0bpw-mul1"]


@pytest.mark.parametrize("name", MLA)
def test_gpu_mla_logits_match_cpu_reference(dev, name):
    import torch
    from safetensors.torch import load_file

    from exl3tools.runtime.mtp import greedy, greedy_mtp
    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir

    if dev == "cpu":
        pytest.skip("needs CUDA")
    g = load_file(str(fixture_dir(name) / "goldens_logits.safetensors"))
    prompt = g["prompt_p64"].tolist()[:40]           # > index_topk: the DSA path runs
    out, toks = {}, {}
    for backend, device in (("reference", "cpu"), ("triton", "cuda")):
        r = load_runner(fixture_dir(name) / "model", device=device, backend=backend, max_cache_tokens=4096)
        r.add_sequence("s")
        pre = r.step([("s", prompt)], all_logits=True).float().cpu()
        steps = [r.step([("s", [t])]).float().cpu() for t in (3, 900, 11)]
        out[backend] = torch.cat([pre] + steps)
        if r.model.mtp is not None:
            ref = greedy(r.model, prompt[:16], 8)
            assert greedy_mtp(r.model, prompt[:16], 8, 2)[0] == ref
            toks[backend] = ref
        r.close()
    ref, got = out["reference"], out["triton"]
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-2, err
