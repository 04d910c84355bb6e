"""runtime.sampling: generators on a device, and the batched sampler against the per-row one."""

from __future__ import annotations

import pytest
import torch

from exl3tools.runtime.sampling import make_generator, sample, sample_batch


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


def _settings(rng: torch.Generator, n: int, vocab: int):
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=rng))]  # noqa: E731
    temps = [pick([0.0, 0.0, 0.3, 0.7, 1.0, 1.0, 1.3, 2.0]) for _ in range(n)]
    ks = [pick([0, 0, 1, 5, 40, vocab - 1, vocab, vocab + 3]) for _ in range(n)]
    ps = [pick([1.0, 1.0, 0.9, 0.5, 0.95, 1e-6, 0.999]) for _ in range(n)]
    return temps, ks, ps


@pytest.mark.parametrize("vocab", [2048, 1001])
def test_sample_batch_equals_per_row_sample(vocab):
    """Many seeds, batch sizes and mixed settings: identical tokens, and each row's generator
    left in the same state as after the per-row call."""
    rng = torch.Generator().manual_seed(vocab)
    checked = 0
    for trial in range(60):
        n = [1, 2, 7, 32][trial % 4]
        logits = torch.randn(n, vocab, generator=rng) * float(torch.rand(1, generator=rng) * 6 + 0.5)
        if trial % 5 == 0:
            logits[:, :50] = logits[:, :50].round()  # exact ties at the top-k/top-p boundary
        temps, ks, ps = _settings(rng, n, vocab)
        seeds = [1000 * trial + i for i in range(n)]
        g_row = [make_generator(s) for s in seeds]
        g_bat = [make_generator(s) for s in seeds]
        want = [sample(logits[i], temps[i], ks[i], ps[i], g_row[i]) for i in range(n)]
        got = sample_batch(logits, temps, ks, ps, [None if t <= 0 else g for t, g in zip(temps, g_bat, strict=True)])
        assert got == want, (trial, temps, ks, ps)
        # generators advanced alike: the next draw matches too (greedy rows never touched theirs)
        for i in range(n):
            assert torch.equal(g_row[i].get_state(), g_bat[i].get_state())
        checked += n
    assert checked > 500


def test_sample_batch_samples_and_is_greedy_where_asked():
    rng = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=rng)
    greedy = sample_batch(logits, [0.0] * 6, [0] * 6, [1.0] * 6, [None] * 6)
    assert greedy == logits.argmax(-1).tolist()
    gens = [make_generator(i) for i in range(6)]
    hot = [sample_batch(logits, [5.0] * 6, [0] * 6, [1.0] * 6, gens) for _ in range(20)]
    assert len({tuple(h) for h in hot}) > 10              # hot rows really draw
    top3 = [set(torch.topk(logits[i], 3).indices.tolist()) for i in range(6)]
    for _ in range(20):
        toks = sample_batch(logits, [10.0] * 6, [3] * 6, [1.0] * 6, gens)
        assert all(t in top3[i] for i, t in enumerate(toks))


def test_sample_batch_refuses_nan_rows():
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        sample_batch(logits, [1.0] * 3, [0] * 3, [1.0] * 3, [make_generator(i) for i in range(3)])
    with pytest.raises(ValueError):
        sample(logits[1], 1.0, 0, 1.0, make_generator(0))
    assert sample_batch(logits[[0, 2]], [1.0, 0.0], [0, 0], [1.0, 1.0], [make_generator(0), None])


def test_draws_follow_the_distribution():
    """Inverse-CDF draws: frequencies within 4 sigma of the probabilities (incl. a 1e-3 token),
    and a token with probability 0 (after top-k) never comes up."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.049, 0.001])
    row = torch.log(p)
    n = 5000
    rows = row.repeat(n, 1)
    toks = torch.tensor(sample_batch(rows, [1.0] * n, [4] * n, [1.0] * n, [make_generator(1)] * n))
    freq = torch.bincount(toks, minlength=5).double() / n
    kept = p[:4].double() / p[:4].sum()
    sigma = (kept * (1 - kept) / n).sqrt()
    assert freq[4] == 0 and bool(((freq[:4] - kept).abs() < 4 * sigma).all()), freq
    toks = torch.tensor([sample(row, 1.0, 0, 1.0, make_generator(s)) for s in range(4000)])
    freq = torch.bincount(toks, minlength=5).double() / 4000
    sigma = (p.double() * (1 - p.double()) / 4000).sqrt()
    assert bool(((freq - p.double()).abs() < 4 * sigma + 1e-3).all()), freq


def test_top_p_boundary_is_inclusive_in_both():
    """A token whose mass above equals top_p exactly is dropped by both samplers."""
    row = torch.log(torch.tensor([4.0, 2.0, 1.0, 1.0]))
    p0 = float(torch.softmax(row, -1)[0])
    rows = row.repeat(16, 1)
    gens = [make_generator(s) for s in range(16)]
    assert sample_batch(rows, [1.0] * 16, [0] * 16, [p0] * 16, gens) == [0] * 16
    assert {sample(row, 1.0, 0, p0, make_generator(s)) for s in range(16)} == {0}
    assert len(set(sample_batch(rows, [1.0] * 16, [0] * 16, [0.99] * 16, gens))) > 1


def test_logprobs_matches_log_softmax():
    from exl3tools.runtime.sampling import logprobs

    g = torch.Generator().manual_seed(3)
    row = torch.randn(1000, generator=g) * 4
    ref = torch.log_softmax(row.double(), -1)
    lp, top = logprobs(row, 17, 5)
    assert abs(lp - ref[17].item()) < 1e-5
    want = torch.topk(ref, 5)
    assert [t for t, _ in top] == want.indices.tolist()
    assert max(abs(b - a) for (_, b), a in zip(top, want.values.tolist(), strict=True)) < 1e-5
    assert logprobs(row, 17, 0) == (lp, [])
