"""MTP draft head (GLM-5, DeepSeek-V3: ``model.layers.{num_hidden_layers}``) and exact speculative decoding.

The head, as exllamav3 1.6.5 runs GLM-5's (architecture/glm_moe_dsa_mtp.py):
``x = eh_proj([enorm(embed(token)) | hnorm(state)])`` (2H -> H, EXL3 at ``mtp_bits``), one full
decoder block (MLA + MoE; GLM-5's with its own "full" DSA indexer), ``shared_head.norm``, then the
target's lm_head. ``state`` is the target's hidden after the final norm at the position before
``token``; deeper drafts feed the head its own normed output. The head borrows the target's
embedding and lm_head (the checkpoint carries neither for it). DeepSeek-V3's MTP layer is the same
without the indexer; exllamav3's converter drops it, so only checkpoints written otherwise (other
converters, bench/synth_checkpoint.py) have one.

The head is built once per rank from the tensors under its prefix and lives in ``model.mtp``,
never in ``model.layers``; its attention writes cache slot 0 of its own ``SeqCache(1)``.

Speculative decoding (greedy): draft ``k`` tokens with the head, run the target once over
``[last token, d1..dk]``, accept the longest prefix where the target's argmax equals the draft,
append the target's own token at the first mismatch (or after the last draft). Every emitted
token is the target's argmax given the emitted prefix, so the output equals plain greedy decoding.
``greedy_mtp`` does it on plain per-sequence caches (the reference the tests hold the head to);
``runner_generate`` (``exl3tools generate --mtp``) goes through the serving engine's steps instead
(Runner.draft / verify / accept on the paged cache, any TP, greedy or rejection sampling).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exl3tools.runtime.arch import BuildContext
from exl3tools.runtime.cache import SeqCache
from exl3tools.runtime.layers import Batch, RMSNorm, SeqSpan, load_linear


def truncate(cache: SeqCache, n: int) -> None:
    """Drop everything past ``n`` tokens (rejected drafts); the buffers are reused by later writes."""
    cache.lengths = [min(x, n) for x in cache.lengths]


def mtp_prefix(cfg: dict, ws) -> str | None:
    """``model.layers.{N}`` when the config asks for MTP and the checkpoint carries its eh_proj."""
    n = int(cfg["num_hidden_layers"])
    p = f"model.layers.{n}"
    if int(cfg.get("num_nextn_predict_layers") or 0) <= 0 or not ws.is_linear(f"{p}.eh_proj"):
        return None
    return p


class MTPHead:
    def __init__(self, *, layer_index: int, enorm, hnorm, eh_proj, block, final_norm, target):
        self.layer_index = layer_index            # N = num_hidden_layers (checkpoint index)
        self.enorm, self.hnorm, self.eh_proj = enorm, hnorm, eh_proj
        self.block, self.final_norm = block, final_norm
        self.target = target

    def new_cache(self) -> SeqCache:
        return SeqCache(1)

    def forward(self, cache: SeqCache, states: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (state_i, token_i) at positions cache.length..; returns the newest row's (normed
        state, logits), each (1, ...): what the next draft is read from."""
        return self.forward_many([cache], [states], [tokens])

    @torch.inference_mode()
    def forward_many(self, caches: list[SeqCache], states: list[torch.Tensor],
                     tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of several sequences in one pass (their rows concatenated in order; one row
        out per sequence): one head forward per draft depth for every drafting sequence, not one
        each. Only those rows reach the lm_head: a first draft after a 32k-token prompt writes 32k
        rows into the head's cache, and their logits would be 20 GB of a GLM-5 vocabulary."""
        t = self.target
        dev = t.embed.device
        flat = [tok for toks in tokens for tok in toks]
        emb = t.embed[torch.tensor(flat, dtype=torch.int64, device=dev)].float()
        st = torch.cat([s.float() for s in states]) if len(states) > 1 else states[0].float()
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(st)], dim=-1))
        spans, positions, row = [], [], 0
        for cache, toks in zip(caches, tokens, strict=True):
            p0 = cache.length
            spans.append(SeqSpan(cache, row, len(toks), p0))
            positions.extend(range(p0, p0 + len(toks)))
            row += len(toks)
        batch = Batch(spans, torch.tensor(positions, dtype=torch.int64, device=dev))
        h = self.block(x, batch)
        if row > len(spans):
            h = h[torch.tensor([sp.row + sp.n - 1 for sp in spans], device=dev)]
        h = self.final_norm(h)
        return h, t.logits(h)


def load_mtp(ctx: BuildContext, model, *, indexer_mode: str | None) -> MTPHead | None:
    """The head of ``model.layers.{N}``, or None where the checkpoint has none. ``indexer_mode``:
    "full" where the block carries its own DSA indexer (GLM-5), None without one (DeepSeek-V3)."""
    cfg, ws = ctx.config, ctx.weights
    p = mtp_prefix(cfg, ws)
    if p is None:
        return None
    from exl3tools.runtime.arch.deepseek_v3 import build_block

    eps = float(cfg["rms_norm_eps"])
    H = int(cfg["hidden_size"])
    n = int(cfg["num_hidden_layers"])
    block = build_block(ctx, n, model.rope, indexer_mode=indexer_mode, moe=True, cache_idx=0)
    return MTPHead(layer_index=n, enorm=RMSNorm(ws.tensor(f"{p}.enorm.weight"), eps),
                   hnorm=RMSNorm(ws.tensor(f"{p}.hnorm.weight"), eps),
                   eh_proj=load_linear(ws, f"{p}.eh_proj", in_real=2 * H, out_real=H,
                                       backend=ctx.backend, device=ctx.device),
                   block=block, final_norm=RMSNorm(ws.tensor(f"{p}.shared_head.norm.weight"), eps),
                   target=model)


# ------------------------------------------------------------------ target forward with states
@torch.inference_mode()
def forward_states(model, cache: SeqCache, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target forward of one sequence: (post-final-norm states, logits) for every new row."""
    p0 = cache.length
    n = len(tokens)
    dev = model.embed.device
    batch = Batch([SeqSpan(cache, 0, n, p0)], torch.arange(p0, p0 + n, dtype=torch.int64, device=dev))
    h = model.embed[torch.tensor(tokens, dtype=torch.int64, device=dev)].float()
    for layer in model.layers:
        h = layer(h, batch)
    h = model.norm(h)
    return h, model.logits(h)


@dataclass(slots=True)
class SpecStats:
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """Plain greedy decoding, one target forward per token (the reference for MTP)."""
    cache = model.new_cache()
    _, logits = forward_states(model, cache, list(prompt))
    out = [int(logits[-1].argmax())]
    while len(out) < max_new:
        _, logits = forward_states(model, cache, [out[-1]])
        out.append(int(logits[-1].argmax()))
    return out


def greedy_mtp(model, prompt: list[int], max_new: int, draft_len: int = 1,
               stop: set[int] | None = None, on_tokens=None) -> tuple[list[int], SpecStats]:
    """Greedy decoding with the model's MTP head as draft: same tokens as ``greedy``, fewer target
    forwards. ``stop``: end after one of these tokens; ``on_tokens(list)``: called as tokens land."""
    head: MTPHead = model.mtp
    if head is None:
        raise ValueError("this model has no MTP head")
    if draft_len < 1:
        raise ValueError("draft_len must be >= 1")
    stats = SpecStats()
    cache, mcache = model.new_cache(), head.new_cache()
    states, logits = forward_states(model, cache, list(prompt))
    stats.target_forwards += 1
    tok = int(logits[-1].argmax())
    out = [tok]
    if on_tokens:
        on_tokens([tok])
    # pairs (target state at i, token at i+1) not yet written into the head's cache
    pend_states, pend_tokens = states, list(prompt[1:]) + [tok]
    while len(out) < max_new and not (stop and tok in stop):
        k = min(draft_len, max_new - len(out))
        g, dl = head.forward(mcache, pend_states, pend_tokens)
        committed = mcache.length                   # every pending pair was exact: keep it
        drafts = [int(dl[-1].argmax())]
        while len(drafts) < k:
            g, dl = head.forward(mcache, g[-1:], [drafts[-1]])
            drafts.append(int(dl[-1].argmax()))
        truncate(mcache, committed)
        base = cache.length
        states, logits = forward_states(model, cache, [tok] + drafts)
        stats.target_forwards += 1
        preds = logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and preds[a] == drafts[a] and not (stop and drafts[a] in stop):
            a += 1
        new = drafts[:a] + [preds[a]]
        truncate(cache, base + a + 1)
        stats.drafted += len(drafts)
        stats.accepted += a
        stats.accepted_per_step.append(a)
        if on_tokens:
            keep = new[:max(0, max_new - len(out))]
            if stop:
                cut = next((i for i, t in enumerate(keep) if t in stop), None)
                keep = keep if cut is None else keep[:cut + 1]
            if keep:
                on_tokens(keep)
        out.extend(new)
        tok = new[-1]
        pend_states, pend_tokens = states[:a + 1], new
    out = out[:max_new]
    if stop:
        for i, t in enumerate(out):
            if t in stop:
                out = out[:i + 1]
                break
    return out, stats


# ------------------------------------------------------------------ Runner glue (CLI)
def runner_generate(runner, prompt: list[int], max_new: int, draft_len: int, *, stop: set[int] | None = None,
                    on_tokens=None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    generator=None) -> tuple[list[int], SpecStats]:
    """One completion through the serving engine's speculative steps (Runner.draft / verify /
    accept over the paged cache; with TP every rank follows in lockstep). Greedy (temperature 0)
    gives exactly plain greedy decoding; sampled, the verdict keeps the model's distribution
    (sampling.accept_drafts). The runner must be loaded with ``speculative_tokens >= draft_len``."""
    from exl3tools.errors import UsageError
    from exl3tools.runtime import sampling

    if getattr(runner.model, "mtp", None) is None:
        raise UsageError(f"{runner.model_name}: this checkpoint has no MTP head (--mtp needs GLM-5 or "
                         "DeepSeek-V3 with model.layers.{num_hidden_layers}.* tensors)")
    if draft_len < 1:
        raise UsageError("--mtp must be >= 1")
    if getattr(runner, "spec_k", 0) < draft_len:
        raise UsageError(f"the runner drafts at most {getattr(runner, 'spec_k', 0)} tokens: load it with "
                         f"speculative_tokens={draft_len}")
    stats = SpecStats()
    sid = ("mtp", id(stats))

    def pick(row) -> int:
        return sampling.sample(row, temperature, top_k, top_p, generator)

    def emit(new: list[int], done: int) -> list[int]:
        keep = new[:max(0, max_new - done)]
        if stop:
            cut = next((i for i, t in enumerate(keep) if t in stop), None)
            keep = keep if cut is None else keep[:cut + 1]
        if keep and on_tokens:
            on_tokens(keep)
        return keep

    cached = runner.add_sequence(sid, list(prompt))
    try:
        logits = runner.step([(sid, list(prompt)[cached:])], device_logits=True)
        stats.target_forwards += 1
        out = emit([pick(logits[0])], 0)
        while out and len(out) < max_new and not (stop and out[-1] in stop):
            tok = out[-1]
            drafts, rows = runner.draft(sid, tok, min(draft_len, max_new - len(out)), pick)
            target = runner.verify([(sid, [tok] + drafts)])
            stats.target_forwards += 1
            a, nxt = sampling.accept_drafts(target, rows, drafts, temperature, top_k, top_p, generator)
            runner.accept(sid, a + 1)
            stats.drafted += len(drafts)
            stats.accepted += a
            stats.accepted_per_step.append(a)
            out += emit(drafts[:a] + [nxt], len(out))
    finally:
        runner.free_sequence(sid)
    return out, stats


def generate_cli(runner, ids: list[int], max_tokens: int, draft_len: int, *, ignore_eos: bool, as_json: bool,
                 t_load: float, tp: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator=None) -> None:
    """``exl3tools generate --mtp N``: stream the completion, then print the acceptance rate."""
    import time

    import click

    from exl3tools.cli._output import emit_json, status

    out: list[int] = []
    shown = ""

    def on_tokens(new: list[int]) -> None:
        nonlocal shown
        out.extend(new)
        if not as_json and runner.tokenizer is not None:
            text = runner.tokenizer.decode(out)
            if not text.endswith("\ufffd"):
                click.echo(text[len(shown):], nl=False)
                shown = text

    t0 = time.perf_counter()
    toks, st = ([], SpecStats()) if max_tokens == 0 else runner_generate(
        runner, ids, max_tokens, draft_len, stop=None if ignore_eos else set(runner.eos_token_ids),
        on_tokens=on_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    dt = time.perf_counter() - t0
    text = runner.tokenizer.decode(toks) if runner.tokenizer is not None else None
    mtp = {"draft_len": draft_len, "drafted": st.drafted, "accepted": st.accepted,
           "acceptance_rate": round(st.acceptance_rate, 4), "target_forwards": st.target_forwards}
    if as_json:
        emit_json({"model": runner.model_name, "tp": tp, "prompt_ids": ids, "completion_ids": toks, "text": text,
                   "load_s": round(t_load, 3), "prompt_tokens": len(ids), "completion_tokens": len(toks),
                   "tok_s": round(len(toks) / dt, 2) if dt and toks else None, "mtp": mtp})
        return
    if runner.tokenizer is None:
        click.echo(",".join(map(str, toks)), nl=False)
    click.echo()
    status(f"{len(ids)} prompt tokens, {len(toks)} generated with MTP draft {draft_len}: accepted "
           f"{st.accepted}/{st.drafted} drafts ({100 * st.acceptance_rate:.1f}%), {st.target_forwards} target "
           f"forwards, {len(toks) / dt if dt else 0:.2f} tok/s, load {t_load:.1f} s")
