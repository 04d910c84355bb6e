"""Token sampling from one logits row: greedy, temperature, top-k, top-p, seeded generator.

Order (as in exllamav3's default sampler chain and HF): temperature, then top-k, then top-p
over the remaining tokens, then a multinomial draw with ``generator``. ``temperature <= 0``
means greedy (argmax; ties to the lowest id).
"""

from __future__ import annotations

import torch


def sample(logits_row: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    logits = logits_row.float().reshape(-1)
    if temperature is None or temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / float(temperature)
    if top_k and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        before = torch.cumsum(probs, -1) - probs          # mass strictly above each token
        drop = before >= top_p                            # keeps at least the top token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


def logprobs(logits_row: torch.Tensor, token: int, top_n: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of ``token``, the ``top_n`` most likely (token, logprob) pairs), from the
    unmodified distribution (temperature 1), as OpenAI-style APIs report them."""
    lp = torch.log_softmax(logits_row.float().reshape(-1), -1)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        v, i = torch.topk(lp, min(top_n, lp.numel()))
        top = [(int(a), float(b)) for a, b in zip(i, v, strict=True)]
    return float(lp[token]), top


def make_generator(seed: int | None, device: torch.device | str | None = None) -> torch.Generator:
    """A generator for ``sample`` on ``device`` (default CPU): torch.multinomial and friends
    refuse a CPU generator for CUDA probabilities. ``seed=None``: a random seed."""
    g = torch.Generator(device=device if device is not None else "cpu")
    if seed is not None:
        g.manual_seed(int(seed))
    else:
        g.seed()
    return g
