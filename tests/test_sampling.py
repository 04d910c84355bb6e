"""runtime.sampling: generators on a device, and the batched sampler against the per-row one."""

from __future__ import annotations

import pytest
import torch

from exl3tools.runtime.sampling import make_generator, sample


def test_make_generator_takes_a_device():
    g = make_generator(5, device="cpu")
    assert g.device.type == "cpu" and make_generator(5).device.type == "cpu"
    assert g.initial_seed() == 5
    row = torch.randn(512, generator=torch.Generator().manual_seed(0))
    a = [sample(row, 1.0, 0, 1.0, make_generator(9, device=torch.device("cpu"))) for _ in range(3)]
    assert a == [sample(row, 1.0, 0, 1.0, make_generator(9))] * 3
    assert make_generator(None, device="cpu").initial_seed() != make_generator(None).initial_seed()
    with pytest.raises(RuntimeError):
        make_generator(1, device="no-such-device")
