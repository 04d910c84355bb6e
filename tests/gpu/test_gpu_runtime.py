"""The runtime on the GPU with our kernels gives the CPU reference runtime's logits (fp16 tolerance)."""

from __future__ import annotations

import pytest

GQA = ["llama-4.0bpw-mul1", "qwen3_moe-2.5bpw-mul1", "glm4_moe-3.0bpw-mcg"]


@pytest.mark.parametrize("name", GQA)
def test_gpu_logits_match_cpu_reference(dev, name):
    import torch

    from exl3tools.runtime.runner import load_runner
    from tests.conftest import fixture_dir

    if dev == "cpu":
        pytest.skip("needs CUDA")
    model = fixture_dir(name) / "model"
    prompt = [1, 17, 300, 42, 1999, 7, 512, 88, 1024, 5, 6, 77]
    out = {}
    for backend, device in (("reference", "cpu"), ("triton", "cuda")):
        r = load_runner(model, device=device, backend=backend, max_cache_tokens=4096)
        r.add_sequence("s")
        pre = r.step([("s", prompt)], all_logits=True).float().cpu()
        steps = [r.step([("s", [t])]).float().cpu() for t in (3, 900, 11)]   # cached decode
        out[backend] = torch.cat([pre] + steps)
        r.close()
    ref, got = out["reference"], out["triton"]
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-2, err
    assert torch.equal(got.argmax(-1), ref.argmax(-1)) or err < 3e-3


@pytest.mark.parametrize("name", ["qwen3_moe-2.5bpw-mul1", "glm4_moe-3.0bpw-mcg"])
def test_moe_tiles_equal_pairs_and_reference_on_cuda(dev, name):
    """The CUDA backend's expert-sorted tiles (CudaExperts.tiles, unused tiles skipped in the gemv)
    equal its one-row-per-pair path and the CPU reference MoE, from 1 to 300 tokens."""
    import torch

    from exl3tools.runtime.layers import MoE
    from exl3tools.runtime.loader import resolve
    from exl3tools.runtime.runner import build_local_model
    from tests.conftest import fixture_dir

    if dev == "cpu":
        pytest.skip("needs CUDA")
    layout = resolve(fixture_dir(name) / "model", 1)
    gpu = build_local_model(layout, 0, 1, backend="cuda", device="cuda")
    cpu = build_local_model(layout, 0, 1)
    i = next(j for j, layer in enumerate(cpu.layers) if isinstance(layer.mlp, MoE))
    mg, mc = gpu.layers[i].mlp, cpu.layers[i].mlp
    assert mg._tiled()
    for T in (1, 5, 64, 300):
        x = torch.randn(T, cpu.info.hidden_size, generator=torch.Generator().manual_seed(T))
        ref = mc(x)
        with torch.inference_mode():
            tiles = mg.forward_static(x.cuda(), tiles=True).cpu()
            pairs = mg.forward_static(x.cuda(), tiles=False).cpu()
        for got in (tiles, pairs):
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            assert err < 1e-2, (T, err)
        assert (tiles - pairs).abs().max().item() <= 1e-3 * pairs.abs().max().item()
