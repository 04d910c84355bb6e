"""Token sampling from one logits row: greedy, temperature, top-k, top-p, seeded generator.

Order (as in exllamav3's default sampler chain and HF): temperature, then top-k, then top-p
over the remaining tokens, then a draw with ``generator``. ``temperature <= 0``
means greedy (argmax; ties to the lowest id).

``sample`` does one row; ``sample_batch`` does many rows in a few tensor ops and gives exactly
``sample``'s tokens (tests/test_sampling.py): scalars enter both as float32 device tensors (a CUDA
division by a host scalar multiplies by its reciprocal, one bit off), and the draw is the inverse
CDF at one uniform per row, taken from that row's own generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def sample(logits_row: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    if temperature is None or temperature <= 0:
        return int(torch.argmax(logits_row.float().reshape(-1)))
    return _draw(distribution(logits_row, temperature, top_k, top_p), generator)


def _uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One float64 U[0, 1) per row: the draw is the inverse CDF at u (cumulative sums in float64,
    so probabilities down to ~1e-16 keep their share). One random number per row, not one per
    vocabulary entry, and a row consumes its generator the same way alone or in a batch."""
    return torch.rand(1, dtype=torch.float64, generator=generator, device=device)


CPU_CHUNK_ELEMS = 1 << 18  # rows x vocab per pass on CPU: a pass stays in cache (measured: a
# 32 x 152k float64 cumsum in one go ran 4x slower than row by row)


def sample_batch(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int],
                 top_p: Sequence[float], generators: Sequence[torch.Generator | None]) -> list[int]:
    """``sample`` for every row of ``logits [B, vocab]`` in a few tensor ops, each row with its own
    settings and generator; the same tokens as calling ``sample`` row by row, in order. Greedy rows
    (temperature <= 0) take the argmax and leave their generator alone."""
    out = sample_batch_device(logits, temperature, top_k, top_p, generators).tolist()
    bad = [i for i, t in enumerate(out) if t < 0]
    if bad:
        raise ValueError(f"cannot sample rows {bad}: NaN or no finite logit")
    return out


def on_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host synchronisation: a CUDA
    tensor built from a list is a blocking copy (PyTorch synchronises the stream after it, so the
    host waits for every kernel launched before), so the values go through pinned memory and an
    asynchronous copy instead (the caching host allocator keeps the buffer until the copy ran)."""
    t = torch.tensor(values, dtype=dtype)
    if getattr(device, "type", device) != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def sample_batch_device(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int],
                        top_p: Sequence[float], generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """``sample_batch`` without a host synchronisation: the tokens stay on the logits' device
    (int64 ``[B]``), -1 for a sampled row that holds NaN or no finite logit. The serving engine
    feeds them to the next decode step before it reads them (runtime.runner.Runner.step_chained)."""
    logits = logits.float().reshape(len(temperature), -1)
    n, vocab = logits.shape
    dev = logits.device
    hot = [i for i in range(n) if temperature[i] is not None and temperature[i] > 0]
    if not hot:
        return torch.argmax(logits, -1)
    cold = [i for i in range(n) if i not in set(hot)]
    out = torch.zeros(n, dtype=torch.int64, device=dev)
    if cold:
        cidx = on_device(cold, dev)
        out.index_copy_(0, cidx, torch.argmax(logits.index_select(0, cidx), -1))
    step = len(hot) if dev.type != "cpu" else max(1, CPU_CHUNK_ELEMS // vocab)
    toks = []
    for c in range(0, len(hot), step):
        rows = hot[c:c + step]
        x = logits[rows[0]:rows[0] + 1] if len(rows) == 1 else (
            logits.index_select(0, on_device(rows, dev)) if len(rows) < n else logits)
        toks.append(_draw_rows(x, [temperature[i] for i in rows], [top_k[i] for i in rows],
                               [top_p[i] for i in rows], [generators[i] for i in rows]))
    tok = toks[0] if len(toks) == 1 else torch.cat(toks)
    return out.index_copy(0, on_device(hot, dev), tok)


class DeviceTokens:
    """Sampled tokens left on the device, with their host copy already under way (a pinned
    buffer, copied in stream order right after sampling): ``tolist`` waits for that copy only,
    not for work launched after it (the next decode step), and ``rows`` feeds them on."""

    def __init__(self, tokens: torch.Tensor):
        self.tensor = tokens
        self._event = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

    def rows(self, keep: list[int] | None = None) -> torch.Tensor:
        """The tokens of rows ``keep`` (all: None) on the device, -1 (not sampled) read as 0."""
        t = self.tensor if keep is None else self.tensor.index_select(0, on_device(keep, self.tensor.device))
        return t.clamp(min=0)


def sample_device(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int],
                  top_p: Sequence[float], generators: Sequence[torch.Generator | None]) -> DeviceTokens:
    """``sample_batch_device`` with the host copy started (the serving engine's sampler)."""
    return DeviceTokens(sample_batch_device(logits, temperature, top_k, top_p, generators))


def _draw_rows(x: torch.Tensor, temps: list, ks: list, ps: list, gens: list) -> torch.Tensor:
    """``sample``'s steps on rows that all sample (temperature > 0); returns their tokens (-1 where
    a row holds NaN or no finite logit)."""
    h, vocab = x.shape
    dev = x.device
    x = x / on_device(temps, dev, torch.float32)[:, None]
    ks = [k if k and 0 < k < vocab else 0 for k in ks]
    if any(ks):
        vals = torch.topk(x, max(ks), dim=-1).values                  # the k-th largest is exact
        kth = vals.gather(1, on_device([[max(k, 1) - 1] for k in ks], dev))
        off = on_device([[k == 0] for k in ks], dev, torch.bool)
        x = x.masked_fill((x < kth) & ~off, float("-inf"))
    rows = [j for j in range(h) if ps[j] is not None and 0 < ps[j] < 1]
    if rows:
        ridx = on_device(rows, dev)
        sub = x.index_select(0, ridx) if len(rows) < h else x
        sorted_logits, order = torch.sort(sub, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, -1)
        before = _cumsum_rows(probs) - probs
        p_t = on_device([[float(ps[j])] for j in rows], dev, torch.float32)
        sorted_logits = sorted_logits.masked_fill(before >= p_t, float("-inf"))
        sub = torch.full_like(sub, float("-inf")).scatter(1, order, sorted_logits)
        x = x.index_copy(0, ridx, sub) if len(rows) < h else sub
    cdf = _cumsum_rows(torch.softmax(x, -1).double())
    total = cdf[:, -1:]
    bad = ~torch.isfinite(total[:, 0])
    u = torch.cat([_uniform(g, dev) for g in gens])[:, None]
    tok = torch.searchsorted(cdf, u * total, right=True).clamp_max(vocab - 1)[:, 0]
    return torch.where(bad, -1, tok)


def _cumsum_rows(t: torch.Tensor) -> torch.Tensor:
    """Cumulative sums along the rows of ``t`` (rows, n), each row's the same whatever the rows:
    CUDA scans a lone row with another algorithm (the whole-tensor scan) than the rows of a
    matrix, whose last sums then differ in rounding; so a seeded row would draw another token
    alone than in a batch. A lone row is scanned as one of two."""
    if t.is_cuda and t.shape[0] == 1:
        return torch.cumsum(t.expand(2, -1).contiguous(), -1)[:1]
    return torch.cumsum(t, -1)


def logprobs(logits_row: torch.Tensor, token: int, top_n: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of ``token``, the ``top_n`` most likely (token, logprob) pairs), from the
    unmodified distribution (temperature 1), as OpenAI-style APIs report them."""
    return logprobs_rows(logits_row.reshape(1, -1), [token], top_n)[0]


def logprobs_rows(rows: torch.Tensor, tokens: Sequence[int], top_n: int = 0,
                  slab: int = 64) -> list[tuple[float, list[tuple[int, float]]]]:
    """``logprobs`` of each row of ``rows`` for its token (a prompt's rows and next tokens: the
    completions' echo), ``slab`` rows at a time (a row's float32 log-softmax is the vocabulary's
    size), in one host copy a slab (token ids < 2**53 are exact in float64): on a GPU one sync."""
    out: list[tuple[float, list[tuple[int, float]]]] = []
    for a in range(0, len(tokens), slab):
        lp = torch.log_softmax(rows[a:a + slab].float(), -1)
        idx = torch.tensor(tokens[a:a + slab], dtype=torch.int64).to(lp.device)
        chosen = lp.gather(1, idx[:, None])
        if top_n > 0:
            v, i = torch.topk(lp, min(top_n, lp.shape[-1]), dim=-1)
            host = torch.cat([chosen.double(), v.double(), i.double()], dim=1).tolist()
        else:
            host = chosen.double().tolist()
        k = (len(host[0]) - 1) // 2
        out.extend((h[0], [(int(t), x) for t, x in zip(h[1 + k:], h[1:1 + k], strict=True)]) for h in host)
    return out


class Adjust:
    """One sequence's logits processing before sampling, on the logits' device, in this order:
    a grammar's mask (``params.grammar``, structured outputs: every token it does not allow next at
    -inf; server/structured.py), ``logit_bias`` (added), ``min_tokens`` (EOS and stop token ids at -inf until that many tokens
    are out), ``repetition_penalty`` over prompt and output (a positive logit divided by it, a
    negative one multiplied: HF/vLLM), ``frequency_penalty`` x count and ``presence_penalty`` x
    (count > 0) over the output (subtracted: OpenAI), then ``min_p`` for sampled rows (tokens whose
    probability at the row's temperature is below min_p x the top one's, at -inf: on raw logits that
    is ``l < l_max + T ln(min_p)``). The sampling chain (temperature, top-k, top-p, draw) follows.
    Logprobs are reported from the unprocessed logits. ``add(token)`` after each emitted token.

    ``params.think_gate`` (open, close, opened): a reasoning model thinks before the grammar holds
    its answer. Unless the prompt opened the thinking, the first token is the grammar's or the
    ``open`` token; inside the thinking no mask applies and the grammar sees nothing; it holds
    every token after ``close``."""

    def __init__(self, params, prompt: Sequence[int], banned: Sequence[int], vocab: int, device):
        self.p, self.vocab, self.device = params, int(vocab), device
        self.n_out = 0
        f32 = dict(dtype=torch.float32, device=device)
        self.counts = torch.zeros(self.vocab, **f32) if (params.presence_penalty or params.frequency_penalty) else None
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(self.vocab, dtype=torch.bool, device=device)
            ids = [t for t in prompt if 0 <= t < self.vocab]
            if ids:
                self.seen[torch.tensor(ids, device=device)] = True
        self.bias = None
        if params.logit_bias:
            ids, vals = zip(*params.logit_bias, strict=True)
            self.bias = torch.zeros(self.vocab, **f32).index_put_(
                (torch.tensor(ids, device=device),), torch.tensor(vals, **f32))
        self.banned = None
        ban = sorted({t for t in banned if 0 <= t < self.vocab})
        if params.min_tokens and ban:
            self.banned = torch.tensor(ban, device=device)
        self.constraint = params.grammar.matcher() if params.grammar is not None else None
        self._bits = torch.arange(32, dtype=torch.int32, device=device) if params.grammar is not None else None
        gate = params.think_gate if self.constraint is not None else None
        # "start" (the open token allowed too), "inside" (no grammar) or None (the grammar holds)
        self.thinking = None if gate is None else ("inside" if gate[2] else "start")
        self._gate = gate

    def allowed(self, n: int) -> torch.Tensor:
        """The grammar's next allowed tokens as an (n,) bool mask on the device (ids past its
        tokenizer's vocabulary: not allowed)."""
        words = torch.frombuffer(bytearray(self.constraint.allowed()), dtype=torch.int32).to(self.device)
        mask = ((words[:, None] >> self._bits) & 1).reshape(-1).bool()
        if mask.numel() < n:
            mask = torch.cat((mask, mask.new_zeros(n - mask.numel())))
        return mask[:n]

    def add(self, token: int) -> None:
        if self.thinking == "start" and token == self._gate[0]:
            self.thinking = "inside"
        elif self.thinking == "inside":
            if token == self._gate[1]:
                self.thinking = None              # the grammar holds from the next token on
        elif self.constraint is not None:
            self.thinking = None
            self.constraint.consume(token)
        self.n_out += 1
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True

    def apply(self, row: torch.Tensor) -> torch.Tensor:
        """The processed copy of one logits row (vocab,), float32."""
        p = self.p
        x = row.float().clone()
        if self.constraint is not None and self.thinking != "inside":
            allowed = self.allowed(x.numel())
            if self.thinking == "start" and self._gate[0] < x.numel():
                allowed[self._gate[0]] = True     # the answer may open its thinking instead
            x = x.masked_fill(~allowed, float("-inf"))
        if self.bias is not None:
            x += self.bias[:x.numel()]
        if self.banned is not None and self.n_out < p.min_tokens:
            x[self.banned] = float("-inf")
        if self.seen is not None:
            x = torch.where(self.seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if self.counts is not None:
            x -= p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0).float()
        if p.min_p and p.temperature and p.temperature > 0:
            x = x.masked_fill(x < x.max() + float(p.temperature) * math.log(p.min_p), float("-inf"))
        return x


def adjust_rows(logits: torch.Tensor, adjusts: Sequence[Adjust | None]) -> torch.Tensor:
    """``logits`` [B, vocab] with each row's ``Adjust`` applied (a new tensor only if any)."""
    if not any(a is not None for a in adjusts):
        return logits
    out = logits.float().clone()
    for i, a in enumerate(adjusts):
        if a is not None:
            out[i] = a.apply(out[i])
    return out


def distribution(row: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The float64 probabilities ``sample`` draws from (temperature > 0): temperature, then top-k,
    then top-p (the token whose mass above reaches ``top_p`` is dropped; the top one always stays)."""
    logits = row.float().reshape(-1)
    logits = logits / torch.tensor(float(temperature), dtype=torch.float32, device=logits.device)
    if top_k and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, -1)
        before = torch.cumsum(probs, -1) - probs          # mass strictly above each token
        p_t = torch.tensor(float(top_p), dtype=torch.float32, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(before >= p_t, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return torch.softmax(logits, -1).double()


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """The inverse CDF of ``probs`` (float64 cumulative sums) at one uniform from ``generator``."""
    cdf = torch.cumsum(probs, -1)
    if not bool(torch.isfinite(cdf[-1])) or float(cdf[-1]) <= 0:
        raise ValueError("cannot sample: the logits row holds NaN or no finite value")
    u = _uniform(generator, probs.device)
    return int(torch.searchsorted(cdf, u * cdf[-1:], right=True).clamp_max(cdf.numel() - 1))


def accept_drafts(target: torch.Tensor, draft_rows: Sequence[torch.Tensor], drafts: Sequence[int],
                  temperature: float, top_k: int, top_p: float,
                  generator: torch.Generator | None, preds: Sequence[int] | None = None) -> tuple[int, int]:
    """Speculative decoding's verdict for one sequence: (drafts accepted, the token after them).

    ``target`` [k+1, vocab]: the target's logits at the last token and at each draft;
    ``draft_rows``: the draft head's logits each draft was drawn from. Greedy (temperature <= 0):
    drafts are kept while they are the target's argmax, and the next token is the target's argmax
    (exactly greedy decoding). Sampled: draft d_i is kept with probability min(1, p(d_i) / q(d_i))
    (p, q: the target's and the draft's distributions after temperature / top-k / top-p); at the
    first rejection the token is drawn from max(0, p - q) renormalised, after k acceptances from
    p: every emitted token then follows the target's distribution exactly (Leviathan et al. 2023).
    ``preds``: the greedy case's target argmaxes when the caller took them for a whole batch."""
    if temperature is None or temperature <= 0:
        preds = target.float().argmax(-1).tolist() if preds is None else list(preds)
        a = 0
        while a < len(drafts) and preds[a] == drafts[a]:
            a += 1
        return a, int(preds[a])
    for i, d in enumerate(drafts):
        p = distribution(target[i], temperature, top_k, top_p)
        q = distribution(draft_rows[i], temperature, top_k, top_p)
        u = float(_uniform(generator, p.device))
        if float(q[d]) > 0 and u < min(1.0, float(p[d]) / float(q[d])):
            continue
        resid = (p - q).clamp(min=0)
        return i, _draw(resid if float(resid.sum()) > 0 else p, generator)
    return len(drafts), _draw(distribution(target[len(drafts)], temperature, top_k, top_p), generator)


def make_generator(seed: int | None, device: torch.device | str | None = None) -> torch.Generator:
    """A generator for ``sample`` on ``device`` (default CPU): torch refuses a CPU generator
    for CUDA tensors. ``seed=None``: a random seed."""
    g = torch.Generator(device=device if device is not None else "cpu")
    if seed is not None:
        g.manual_seed(int(seed))
    else:
        g.seed()
    return g
