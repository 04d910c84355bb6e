"""What the engine samples one choice with (``SamplingParams``), built from a validated request's
fields and the model's generation_config.json defaults (``sampling_params``), and a request ready
for the engine (``Prepared``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from exl3tools.server.api_errors import bad_request

if TYPE_CHECKING:
    from exl3tools.server.request_models import _Sampling

MAX_STOP_LEN = 256      # characters of one stop sequence (their count: request_body.MAX_STOP)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the engine needs for one choice; validated, normalised, immutable."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: off; k: chosen token + k alternatives
    # completions' echo with logprobs: each prompt token's logprob and k alternatives (None: off)
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    grammar: Any = None  # response_format's checked grammar: has matcher() (server/structured.py)
    # a reasoning model's thinking before the grammar (server/reasoning.think_gate): (the <think>
    # token, the </think> token, whether the prompt opened it); the grammar holds what follows
    think_gate: tuple[int, int, bool] | None = None

    @property
    def token_by_token(self) -> bool:
        """Logprobs or processed logits: each token is read on the host before the next step
        (the engine neither chains nor drafts such a row)."""
        return self.logprobs is not None or self.adjusts_logits

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are processed before sampling (runtime.sampling.Adjust)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or (self.min_p and self.temperature > 0)
                    or self.grammar is not None)


@dataclass(slots=True)
class Prepared:
    """A validated request, tokenised: prompts x n choices."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


def _logit_bias(req: _Sampling, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}."""
    bias = req.logit_bias or {}      # its entry count: parse_body's _refuse_oversized_lists
    out = []
    for key, value in bias.items():
        # ASCII digits only: str.isdigit() also takes "²" (which int() refuses) and "٥"
        if not (key.isascii() and key.isdigit()) or len(key) > 12 or not 0 <= int(key) < vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key[:40]!r}",
                              param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _stops(req: _Sampling, vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])   # counts: parse_body
    for s in stop:
        if not s or len(s) > MAX_STOP_LEN:
            raise bad_request(f"stop sequences must have 1 to {MAX_STOP_LEN} characters", param="stop")
    ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < vocab_size for t in ids):
        raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size})",
                          param="stop_token_ids")
    return tuple(stop), tuple(ids)


def sampling_params(req: _Sampling, *, max_tokens: int, logprobs: int | None,
                    vocab_size: int, defaults: dict | None = None) -> SamplingParams:
    """``defaults`` (the model's generation_config.json: temperature, top_p, top_k,
    repetition_penalty, min_p) fill the fields the request leaves out; then OpenAI's 1 / 1 / off
    and no penalty, no min_p."""
    stop, stop_ids = _stops(req, vocab_size)
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
    d = defaults or {}
    top_k = d.get("top_k", 0) if req.top_k is None else req.top_k
    top_k = top_k if top_k > 0 else 0
    temperature = d.get("temperature", 1.0) if req.temperature is None else req.temperature
    top_p = d.get("top_p", 1.0) if req.top_p is None else req.top_p
    repetition_penalty = d.get("repetition_penalty", 1.0) if req.repetition_penalty is None else req.repetition_penalty
    min_p = d.get("min_p", 0.0) if req.min_p is None else req.min_p
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=req.seed, stop=stop, stop_token_ids=stop_ids, logprobs=logprobs,
                          ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty or 0.0,
                          frequency_penalty=req.frequency_penalty or 0.0,
                          repetition_penalty=repetition_penalty, logit_bias=_logit_bias(req, vocab_size), min_p=min_p,
                          min_tokens=req.min_tokens or 0)
