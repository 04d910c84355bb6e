"""Bounds on what one request (or one CLI option) may make the runtime do, checked before the work.

Threats (issue 16): a 15.7 MB prompt was tokenized for 29-74 s, with 1.8 GB of RSS, before the
context-length check rejected it; ``temperature`` 1e-46 is 0 in the float32 sampler (NaN, HTTP
500); ``--api-key ""`` let in anyone who sent an empty key. Everything here is cheap: lengths of
strings already parsed, one pass over the tokenizer's vocabulary per model. No torch, no pydantic
(``exl3tools generate`` uses the sampling bounds too).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from exl3tools.errors import UsageError
from exl3tools.server.api_errors import APIError

# The text of one request's prompts (or chat messages, or the rendered chat) is tokenized only
# below this many characters: about 1M tokens of English, ~15 s and a few hundred MB to tokenize.
MAX_PROMPT_CHARS = 4 * 1024 * 1024

# The sampler divides logits by the temperature in float32 (runtime/sampling.py): 1e-46 is 0 there,
# and logits / t overflows once |logit| > 3.4e38 * t. At 1e-30 that needs |logit| > 3.4e8, far
# beyond fp16/bf16 logits. Positive values below it are refused (0 means greedy); the same floor
# keeps top_p non-zero in float32.
MIN_SAMPLING_VALUE = 1e-30


# ---------------------------------------------------------------------- sampling values


def sampling_value_problem(name: str, value: float | None, *, upper: float, zero_ok: bool) -> str | None:
    """Why ``value`` cannot drive the float32 sampler (None: it can). ``zero_ok``: 0 is allowed
    (temperature: greedy); else the value must be positive (top_p)."""
    if value is None:
        return None
    if not math.isfinite(value):
        return f"{name} must be a finite number, got {value}"
    if value < 0 or value > upper or (value == 0 and not zero_ok):
        low = ">= 0" if zero_ok else "> 0"
        high = f" and <= {upper:g}" if math.isfinite(upper) else ""
        return f"{name} must be {low}{high}, got {value:g}"
    if 0 < value < MIN_SAMPLING_VALUE:
        zero = " (use 0 for greedy decoding)" if zero_ok else ""
        return (f"{name} {value:g} underflows the float32 sampler: give 0 or at least "
                f"{MIN_SAMPLING_VALUE:g}{zero}")
    return None


# ---------------------------------------------------------------------- API keys


def check_api_keys(keys: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The keys as given, or UsageError for an empty one: a blank key would let in every client
    that sends a blank ``x-api-key`` header (and the presented key is compared stripped)."""
    for k in keys:
        if not isinstance(k, str) or not k.strip():
            raise UsageError("an API key must not be empty (an empty --api-key or "
                             "EXL3TOOLS_SERVE_API_KEY would accept a blank key); give a real key or none")
        if k != k.strip():
            raise UsageError("an API key must not start or end with whitespace (clients' keys are "
                             "compared stripped)")
    return tuple(keys)


# ---------------------------------------------------------------------- prompt sizes


@dataclass(frozen=True, slots=True)
class PromptGuard:
    """Size checks on prompt text before any tokenization.

    ``limit``: the tokens a prompt must fit into (the context, or the cache budget if smaller).
    ``chars_per_token``: a proven upper bound on the characters one token of this tokenizer can
    cover (``chars_per_token()``), or None where none can be proven; then only the absolute cap
    ``MAX_PROMPT_CHARS`` applies."""

    limit: int
    chars_per_token: int | None = None

    @classmethod
    def for_runner(cls, runner: Any, cache_budget: int = 0) -> PromptGuard:
        ctx = runner.max_context
        limit = min(ctx, cache_budget) if cache_budget else ctx
        tok = getattr(runner, "tokenizer", None)
        return cls(limit, chars_per_token(tok) if tok is not None else None)

    @property
    def max_chars(self) -> int:
        """A text longer than this is refused without tokenizing it."""
        if self.chars_per_token is None:
            return MAX_PROMPT_CHARS
        return min(MAX_PROMPT_CHARS, self.limit * self.chars_per_token)

    def check_text(self, n_chars: int, param: str) -> None:
        """One prompt (or the rendered chat) of ``n_chars`` characters."""
        if self.chars_per_token is not None and n_chars > self.limit * self.chars_per_token:
            at_least = -(-n_chars // self.chars_per_token)
            raise APIError(400, f"this model's maximum context length is {self.limit} tokens; the "
                           f"{param} has {n_chars} characters, which is at least {at_least} tokens "
                           f"(checked before tokenizing)", param=param, code="context_length_exceeded")
        self.check_total(n_chars, param)

    @staticmethod
    def check_total(n_chars: int, param: str) -> None:
        """All the text of one request: the absolute cap, whatever the tokenizer."""
        if n_chars > MAX_PROMPT_CHARS:
            raise APIError(413, f"the {param} has {n_chars} characters; this server tokenizes at "
                           f"most {MAX_PROMPT_CHARS} per request", param=param, code="request_too_large")

    def check_prompts(self, prompts: list[str | list[int]]) -> None:
        """Completions: each text prompt against the context, their total against the cap; token
        prompts by length (exact)."""
        total = 0
        for p in prompts:
            if isinstance(p, str):
                self.check_text(len(p), "prompt")
                total += len(p)
            elif len(p) > self.limit:
                raise APIError(400, f"this model's maximum context length is {self.limit} tokens; "
                               f"the prompt has {len(p)}", param="prompt", code="context_length_exceeded")
        self.check_total(total, "prompt")

    def check_messages(self, messages: list[dict[str, Any]], param: str = "messages") -> None:
        """Chat, before rendering: the absolute cap on the messages' text (``param``: their field's
        name). (The context check runs on the rendered text: a template may drop parts of messages.)"""
        self.check_total(sum(len(m.get("content") or "") for m in messages), param)


# ---------------------------------------------------------------------- chars per token

# How many characters of input a normalizer step may turn into one (None: unbounded, e.g. Strip
# or StripAccents delete characters). NFC/NFKC compose at most 4 characters into one (the longest
# canonical decomposition; tests/test_server_limits.py checks it against unicodedata).
_NORMALIZERS = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1, "NFC": 4, "NFKC": 4}
# Pre-tokenizers only split (or map bytes to characters) unless they remove what they split on.
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}


def _normalizer_shrink(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        out = 1
        for step in spec.get("normalizers") or []:
            f = _normalizer_shrink(step)
            if f is None:
                return None
            out *= f
        return out
    if kind == "Replace":  # a fixed string for a fixed non-empty string: bounded
        pat, content = (spec.get("pattern") or {}).get("String"), spec.get("content")
        if isinstance(pat, str) and pat and isinstance(content, str) and content:
            return max(1, -(-len(pat) // len(content)))
        return None
    return _NORMALIZERS.get(kind)


def _pre_tokenizer_ok(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_ok(s) for s in spec.get("pretokenizers") or [])
    return kind in _PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def chars_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the input characters one token can cover, or None where none is provable.

    Proven only for BPE that can spell every input (byte-level alphabet, or byte fallback), so no
    character is dropped or fused into an unknown token; with normalizers and pre-tokenizers that
    never delete characters; and no added token that swallows neighbouring whitespace. Then each
    token covers at most its own length in characters (byte-level: one character per byte) times
    the normalizers' composition factor, so ``n_chars / bound`` tokens is a lower bound."""
    try:
        spec = json.loads(tokenizer.to_str())
    except Exception:  # noqa: BLE001 - any tokenizer we cannot read gets only the absolute cap
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not vocab:
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_ok(spec.get("pre_tokenizer")):
        return None
    if _mentions(spec.get("pre_tokenizer"), "ByteLevel"):
        from tokenizers.pre_tokenizers import ByteLevel

        spelled = all(ch in vocab for ch in ByteLevel.alphabet())
    else:
        spelled = bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in vocab for b in range(256))
    added = [t for t in spec.get("added_tokens") or [] if isinstance(t, dict)]
    if not spelled or any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    longest = max(max(map(len, vocab)), max((len(t.get("content") or "") for t in added), default=0))
    return max(1, longest) * shrink


def _mentions(spec: dict | None, kind: str) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_mentions(s, kind) for s in spec.get("pretokenizers") or [])
    return spec.get("type") == kind
