"""Sampling on CUDA: generators on the device, batched == per-row on the device."""

from __future__ import annotations

import pytest
import torch

from exl3tools.runtime.sampling import make_generator, sample, sample_batch
from tests.conftest import gpu


@gpu
@pytest.mark.parametrize("vocab", [2048, 151552])
def test_cuda_generator_and_batched_sampler(vocab):
    g = make_generator(3, device="cuda")
    assert g.device.type == "cuda"
    rng = torch.Generator().manual_seed(vocab)
    for trial in range(20):
        n = 16
        logits = (torch.randn(n, vocab, generator=rng) * 3).cuda()
        temps = [[0.0, 0.7, 1.0, 1.5][(i + trial) % 4] for i in range(n)]
        ks = [[0, 5, 50, 0][(i + 2 * trial) % 4] for i in range(n)]
        ps = [[1.0, 0.9, 0.5, 0.95][(i + 3 * trial) % 4] for i in range(n)]
        a = [make_generator(100 * trial + i, device="cuda") for i in range(n)]
        b = [make_generator(100 * trial + i, device="cuda") for i in range(n)]
        want = [sample(logits[i], temps[i], ks[i], ps[i], a[i]) for i in range(n)]
        assert sample_batch(logits, temps, ks, ps, b) == want
        assert all(torch.equal(x.get_state(), y.get_state()) for x, y in zip(a, b, strict=True))


@gpu
def test_device_sampling_never_synchronises():
    """sample_batch_device's contract (the chained decode steps and speculative rounds rely on
    it): no host synchronisation for greedy, sampled (top-k, top-p) and mixed rows, nor for
    DeviceTokens.rows or the block-table updates' copy. Under torch's sync debug mode "error" a
    tensor built from a list on the device (a blocking copy) raises."""
    from exl3tools.runtime.sampling import DeviceTokens, on_device, sample_batch_device

    logits = torch.randn(6, 4096, device="cuda")
    gens = [make_generator(i, device="cuda") for i in range(6)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.tensor([1, 2], device="cuda")                  # the mode does catch it
        for temps in ([0.0] * 6, [0.7] * 6, [0.0, 0.8, 0.0, 1.2, 0.5, 0.0]):
            tok = sample_batch_device(logits, temps, [0, 50, 0, 5, 0, 0], [1.0, 0.9, 1.0, 0.5, 1.0, 1.0], gens)
            DeviceTokens(tok).rows([0, 2, 5])
        on_device([[1, 2, 3]], torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
