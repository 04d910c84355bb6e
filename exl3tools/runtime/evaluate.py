"""eval: perplexity over a token stream with a sliding window, and KL against a reference model.

Windows (as the Hugging Face perplexity guide strides them): window ``W`` tokens, stride ``S``;
window ``i`` covers ``[i*S, min(i*S + W, n))`` and scores only the tokens the previous window did
not (the first window every token but the first; ``S < W``, so every token is scored once), each predicted from everything before it in its
window. Each window is a fresh sequence on the Runner: one ``step(all_logits=True)``.

    nll(t)  = -log softmax(logits[t-1])[token t]          (float64)
    ppl     = exp(mean nll over scored tokens)
    KL(t)   = sum_v P_ref(v) (log P_ref(v) - log P(v)), P = softmax of the row predicting t

KL is KL(reference || model), as the fixtures' goldens compute ``kl_vs_hf_bf16``; reported as mean,
p50, p90, p99 and max over the scored positions, with the top-1 agreement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from exl3tools.errors import UsageError

SCHEMA_ID = "https://exl3tools.dev/schemas/eval.v1.json"
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class EvalResult:
    path: str
    text: str
    tokens: int
    scored: int
    window: int
    stride: int
    windows: int
    nll_mean: float
    perplexity: float
    reference: str | None = None
    reference_perplexity: float | None = None
    kl: dict[str, float] | None = None       # mean, p50, p90, p99, max, top1_agree

    def to_json(self) -> dict[str, Any]:
        return {"$schema": SCHEMA_ID, "schema_version": 1, **asdict(self)}


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over ``n`` tokens."""
    if window < 2 or not 1 <= stride < window:   # stride < window: every token has context to score
        raise UsageError(f"--window must be >= 2 and --stride in 1..window-1, got {window} and {stride}")
    out, prev_end, begin = [], 1, 0
    while prev_end < n:
        end = min(begin + window, n)
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        begin += stride
    return out


def check_tokens(tokens: list[int], text: str = "") -> None:
    if len(tokens) < 2:
        raise UsageError(f"{text or 'the text'}: {len(tokens)} token(s); eval needs at least 2")


def kl_per_position(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P) per row, float64."""
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = torch.log_softmax(logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def kl_summary(kl: torch.Tensor, top1: float) -> dict[str, float]:
    q = torch.quantile(kl, torch.tensor([p / 100 for p in PERCENTILES], dtype=torch.float64))
    return {"mean": kl.mean().item(), **{f"p{p}": v.item() for p, v in zip(PERCENTILES, q, strict=True)},
            "max": kl.max().item(), "top1_agree": top1}


def _window_logits(runner, toks: list[int], vocab: int) -> torch.Tensor:
    sid = "eval"                                        # one window at a time: freed below
    runner.add_sequence(sid)
    try:
        return runner.step([(sid, toks)], all_logits=True)[:, :vocab]
    finally:
        runner.free_sequence(sid)


def evaluate(runner, tokens: list[int], *, window: int, stride: int, reference=None,
             progress: Callable[[int, int], None] | None = None, path: str = "", text: str = "",
             reference_path: str | None = None) -> EvalResult:
    """Perplexity of ``runner`` over ``tokens`` (and KL against ``reference``, another Runner)."""
    check_tokens(tokens, text)
    cap = min(runner.max_context, reference.max_context if reference is not None else runner.max_context)
    if window > cap:                    # the runner's longest context: a smaller window, same overlap
        window, stride = cap, min(stride, cap - 1)
    spans = windows(len(tokens), window, stride)
    vocab = runner.vocab_size if reference is None else min(runner.vocab_size, reference.vocab_size)
    nll, ref_nll, kls, agree = [], [], [], 0
    for i, (b, e, s) in enumerate(spans):
        rows = slice(s - 1 - b, e - 1 - b)                # the rows predicting tokens s..e-1
        target = torch.tensor(tokens[s:e], dtype=torch.int64)
        logits = _window_logits(runner, tokens[b:e], vocab)[rows]
        lp = torch.log_softmax(logits.double(), -1)
        nll.append(-lp.gather(1, target[:, None])[:, 0])
        if reference is not None:
            ref = _window_logits(reference, tokens[b:e], vocab)[rows]
            ref_nll.append(-torch.log_softmax(ref.double(), -1).gather(1, target[:, None])[:, 0])
            kls.append(kl_per_position(ref, logits))
            agree += int((ref.argmax(-1) == logits.argmax(-1)).sum())
        if progress is not None:
            progress(i + 1, len(spans))
    all_nll = torch.cat(nll)
    res = dict(path=path, text=text, tokens=len(tokens), scored=all_nll.numel(), window=window, stride=stride,
               windows=len(spans), nll_mean=all_nll.mean().item(), perplexity=all_nll.mean().exp().item())
    if reference is not None:
        res.update(reference=reference_path, reference_perplexity=torch.cat(ref_nll).mean().exp().item(),
                   kl=kl_summary(torch.cat(kls), agree / all_nll.numel()))
    return EvalResult(**res)


# ------------------------------------------------------------------ diff --prompt: activations
class _Recorder:
    """Stands in for one decoder layer during a forward and keeps its output hidden states."""

    def __init__(self, layer, out: list):
        self._layer, self._out = layer, out

    def __call__(self, h, batch):
        h = self._layer(h, batch)
        self._out.append(h.detach().float().cpu())
        return h

    def __getattr__(self, name):
        return getattr(self._layer, name)


def _hidden_and_logits(runner, tokens: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    if runner.world != 1:
        raise UsageError("diff --prompt/--token-ids runs each model on one process (no --tp)")
    model, states = runner.model, []
    layers = model.layers
    model.layers = [_Recorder(layer, states) for layer in layers]
    try:
        logits = _window_logits(runner, tokens, runner.vocab_size)
    finally:
        model.layers = layers
    return states, logits


def activation_diff(runner_a, runner_b, tokens: list[int]) -> dict[str, Any]:
    """Per decoder layer, the cosine of A's output hidden states to B's (mean and min over tokens),
    and KL(B || A) of the final logits per position (mean, max) with top-1 agreement: B is the
    reference, as in ``exl3tools diff``."""
    check_tokens(tokens)
    ha, la = _hidden_and_logits(runner_a, tokens)
    hb, lb = _hidden_and_logits(runner_b, tokens)
    if len(ha) != len(hb):
        raise UsageError(f"the models have {len(ha)} and {len(hb)} decoder layers")
    layers = []
    for i, (a, b) in enumerate(zip(ha, hb, strict=True)):
        cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
        layers.append({"layer": i, "cosine_mean": cos.mean().item(), "cosine_min": cos.min().item()})
    vocab = min(la.shape[-1], lb.shape[-1])
    kl = kl_per_position(lb[:, :vocab], la[:, :vocab])
    return {"tokens": len(tokens), "layers": layers,
            "logits": {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
                       "top1_agree": (la[:, :vocab].argmax(-1) == lb[:, :vocab].argmax(-1)).double().mean().item()}}
