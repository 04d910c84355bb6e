"""Long-context correctness: our runtime vs exllamav3 1.6.5 on the same checkpoint, 4k/16k/32k-token prompts.

    python3 bench/gpu_long_context.py [NAME=]CKPT [[NAME=]CKPT ...] [--lengths 4096,16384,32768]
        [--positions 64] [--chunk 2048] [--seed 0] [--sides ours,exllamav3] [--backend auto]
        [--device cuda] [--json OUT.json]

Per checkpoint and prompt length: a prompt of random valid token ids (fixed seed), prefilled in
``--chunk``-token steps by each side, logits kept at ``--positions`` sampled positions (stratified
over the prompt, the last position always included):

- ours: ``load_runner(device="cuda")``, one sequence, ``Runner.step(chunk, all_logits=True)`` per
  chunk: the paged cache and the chunked prefill that ``serve`` runs (its --max-prefill-tokens is
  2048 on CUDA);
- exllamav3: ``Config.from_directory`` / ``Model.from_config`` / ``Cache`` / ``model.load`` as
  bench/gpu_e2e_model.py loads it, ``model.forward`` per chunk with ``attn_mode flash_attn``,
  ``past_len`` and ``batch_shape (1, cache tokens)`` (its own chunked prefill).

Reported: KL(exllamav3 || ours) mean and max over the sampled positions (and the mean over those
in the prompt's last quarter), top-1 agreement, and each side's mean NLL of the prompt's own next
tokens over every position. Random synthetic weights give near-flat logits, so greedy tokens mean
little; the numbers are what to read. A long-prefill bug shows as a KL that grows with length and
an NLL gap (the bug this guards against: mean NLL 4.21 vs 0.94 on long prompts).

The sides run one after the other (ours first, then exllamav3), each alone on the GPU. A side that
fails to load or run gives an error column, the other side's NLL still stands. The pure parts
(arguments, prompts, positions, KL/NLL, the table) run on the CPU: tests/test_long_context_bench.py.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import numpy as np  # noqa: E402
import torch  # noqa: E402

SIDES = ("ours", "exllamav3")
PAGE = 256          # exllamav3's cache page: its cache size is a multiple of it

# forward(new tokens, tokens already cached) -> logits (len(new tokens), vocab), any float dtype/device
Forward = Callable[[list[int], int], torch.Tensor]


# ------------------------------------------------------------------ pure helpers (CPU-tested)
def parse_ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(x < 2 for x in out):
        raise argparse.ArgumentTypeError(f"expected integers >= 2 like 4096,16384: {s!r}")
    return out


def parse_sides(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out or any(x not in SIDES for x in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"--sides takes ours and/or exllamav3, got {s!r}")
    return out


def parse_ckpt(s: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (named after its folder, or the folder above a ``model`` folder)."""
    name, sep, path = s.partition("=")
    if not sep:
        p = Path(s)
        name, path = (p.parent.name if p.name == "model" else p.name) or s, s
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected [NAME=]PATH, got {s!r}")
    return name, path


def make_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """``length`` random token ids in [0, vocab), the same for every side (seeded by seed and length)."""
    rng = np.random.default_rng([seed, length])
    return rng.integers(0, vocab, size=length).tolist()


def sample_positions(length: int, n: int, seed: int) -> list[int]:
    """About ``n`` distinct positions, one per stratum of the prompt, the last position always in."""
    n = max(1, min(n, length))
    rng = np.random.default_rng([seed, length, 1])
    pos = {min(length - 1, int((i + rng.random()) * length / n)) for i in range(n - 1)}
    pos.add(length - 1)
    return sorted(pos)


@dataclass(slots=True)
class SideOut:
    """One side's result for one prompt: float32 logits at the sampled positions (CPU), mean NLL."""

    logits: torch.Tensor       # (len(positions), vocab)
    nll: float                 # mean -log p(prompt[t + 1] | prompt[:t + 1]) over t < len - 1
    seconds: float


def run_side(forward: Forward, prompt: list[int], positions: list[int], chunk: int) -> SideOut:
    """Prefill ``prompt`` through ``forward`` in ``chunk``-token steps; keep the sampled rows and the NLL."""
    T = len(prompt)
    want = torch.tensor(positions, dtype=torch.int64)
    rows, nll_sum = [], 0.0
    t0 = time.perf_counter()
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        lg = forward(prompt[c0:c1], c0)
        if lg.shape[0] != c1 - c0:
            raise RuntimeError(f"forward returned {lg.shape[0]} rows for a {c1 - c0}-token chunk")
        logp = torch.log_softmax(lg.float(), dim=-1)
        nxt = min(c1, T - 1) - c0                      # rows of this chunk that predict a prompt token
        if nxt > 0:
            tgt = torch.tensor(prompt[c0 + 1:c0 + 1 + nxt], dtype=torch.int64, device=logp.device)
            nll_sum -= logp[:nxt].gather(1, tgt[:, None]).double().sum().item()
        sel = want[(want >= c0) & (want < c1)] - c0
        if sel.numel():
            rows.append(lg[sel.to(lg.device)].float().cpu())
        del lg, logp
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return SideOut(torch.cat(rows), nll_sum / max(T - 1, 1), time.perf_counter() - t0)


def compare(ref: SideOut, ours: SideOut, positions: list[int], length: int) -> dict:
    """KL(ref || ours) per sampled position (mean, max, mean over the last quarter), top-1 agreement, NLLs."""
    if ref.logits.shape != ours.logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref.logits.shape)} vs {tuple(ours.logits.shape)}")
    lp = torch.log_softmax(ref.logits.double(), dim=-1)
    lq = torch.log_softmax(ours.logits.double(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    tail = torch.tensor([p >= 3 * length // 4 for p in positions])
    return {"positions": len(positions), "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "kl_mean_last_quarter": kl[tail].mean().item() if tail.any() else None,
            "top1_agree": (lp.argmax(-1) == lq.argmax(-1)).double().mean().item(),
            "nll_ref": ref.nll, "nll_ours": ours.nll, "nll_gap": ours.nll - ref.nll}


def _f(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)



def format_table(rows: list[dict]) -> str:
    head = ["checkpoint", "tokens", "KL mean", "KL max", "KL mean (last 1/4)", "top-1 agree",
            "NLL exllamav3", "NLL ours", "s exllamav3", "s ours", "note"]
    lines = [[r["checkpoint"], str(r["tokens"]), _f(r.get("kl_mean"), "{:.2e}"), _f(r.get("kl_max"), "{:.2e}"),
              _f(r.get("kl_mean_last_quarter"), "{:.2e}"), _f(r.get("top1_agree"), "{:.3f}"),
              _f(r.get("nll_ref"), "{:.4f}"), _f(r.get("nll_ours"), "{:.4f}"),
              _f(r.get("s_ref"), "{:.1f}"), _f(r.get("s_ours"), "{:.1f}"), r.get("error", "")] for r in rows]
    w = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |",
           "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    out += ["| " + " | ".join(x[i].ljust(w[i]) for i in range(len(head))) + " |" for x in lines]
    return "\n".join(out)


def rows_for(name: str, lengths: list[int], positions: dict[int, list[int]], outs: dict[str, dict],
             errors: dict[str, str]) -> list[dict]:
    """Table rows of one checkpoint from each side's SideOut per length (a side may be missing)."""
    rows = []
    for L in lengths:
        ref, ours = outs.get("exllamav3", {}).get(L), outs.get("ours", {}).get(L)
        row: dict = {"checkpoint": name, "tokens": L}
        if ref is not None and ours is not None:
            row.update(compare(ref, ours, positions[L], L))
        else:
            row.update(nll_ref=None if ref is None else ref.nll, nll_ours=None if ours is None else ours.nll)
        row["s_ref"] = None if ref is None else ref.seconds
        row["s_ours"] = None if ours is None else ours.seconds
        err = "; ".join(f"{s}: {e}" for s, e in errors.items())
        if err:
            row["error"] = err
        rows.append(row)
    return rows


# ------------------------------------------------------------------ the two sides
_ids = itertools.count()


def ours_forward(runner) -> tuple[Forward, Callable[[], None]]:
    """A fresh sequence in ``runner``: (forward over it, release). Prefix caching never matches it
    (no tokens are given to add_sequence), so every token is computed."""
    sid = f"longctx-{next(_ids)}"
    runner.add_sequence(sid)

    def forward(toks: list[int], past: int) -> torch.Tensor:
        have = runner.sequence_length(sid)
        if have != past:
            raise RuntimeError(f"runner holds {have} tokens, the chunk starts at {past}")
        return runner.step([(sid, toks)], all_logits=True, device_logits=True)
    return forward, lambda: runner.free_sequence(sid)


def run_ours(path: str, lengths, prompts, positions, a) -> dict[int, SideOut]:
    from exl3tools.runtime.runner import load_runner

    top = max(lengths)
    runner = load_runner(path, device=a.device, backend=a.backend, max_context=top, max_cache_tokens=top,
                         max_num_seqs=1, decode="eager", prefix_caching=False)
    try:
        out = {}
        for L in lengths:
            fwd, release = ours_forward(runner)
            try:
                out[L] = run_side(fwd, prompts[L], positions[L], a.chunk)
            finally:
                release()
            print(f"[ours] {L} tokens: NLL {out[L].nll:.4f}, {out[L].seconds:.1f} s", flush=True)
        return out
    finally:
        runner.close()


def run_exllamav3(path: str, lengths, prompts, positions, a) -> dict[int, SideOut]:
    from gpu_e2e_model import load_exllamav3  # its loading, as the decode benchmark does it

    cache_len = -(-max(lengths) // PAGE) * PAGE
    config, model, (cache,), _tok, load_s = load_exllamav3(path, cache_len, 1,
                                                           a.device if ":" in a.device else "cuda:0")
    print(f"[exllamav3] loaded in {load_s:.1f} s, cache {cache_len} tokens", flush=True)
    vocab = config.vocab_size

    def forward(toks: list[int], past: int) -> torch.Tensor:
        ids = torch.tensor([toks], dtype=torch.long)
        lg = model.forward(ids, {"attn_mode": "flash_attn", "cache": cache, "past_len": past,
                                 "batch_shape": (1, cache_len)})
        return lg[0, :, :vocab]
    try:
        out = {}
        for L in lengths:
            out[L] = run_side(forward, prompts[L], positions[L], a.chunk)
            print(f"[exllamav3] {L} tokens: NLL {out[L].nll:.4f}, {out[L].seconds:.1f} s", flush=True)
        return out
    finally:
        try:
            model.unload()
        except Exception as exc:  # noqa: BLE001 - the results are in already
            print(f"[exllamav3] unload: {exc}", flush=True)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:200]


def run_checkpoint(name: str, path: str, a) -> list[dict]:
    cfg = json.loads((Path(path) / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    prompts = {L: make_prompt(L, vocab, a.seed) for L in a.lengths}
    positions = {L: sample_positions(L, a.positions, a.seed) for L in a.lengths}
    outs: dict[str, dict] = {}
    errors: dict[str, str] = {}
    runners = {"ours": run_ours, "exllamav3": run_exllamav3}
    for side in a.sides:
        print(f"[{side}] {name}: {path}", flush=True)
        try:
            outs[side] = runners[side](path, a.lengths, prompts, positions, a)
        except Exception as exc:  # noqa: BLE001 - one side failing must not lose the other
            errors[side] = _one_line(exc)
            print(f"[{side}] {name} failed: {errors[side]}", flush=True)
        _free()         # the side's model and cache are unreachable once its function returned
    return rows_for(name, a.lengths, positions, outs, errors)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpts", nargs="+", type=parse_ckpt, metavar="[NAME=]CKPT")
    ap.add_argument("--lengths", type=parse_ints, default=parse_ints("4096,16384,32768"))
    ap.add_argument("--positions", type=int, default=64, help="sampled positions per prompt")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step (serve: 2048 on CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", type=parse_sides, default=list(SIDES))
    ap.add_argument("--backend", default="auto", help="our kernel backend (load_runner's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, default=None, help="write the rows (and settings) here")
    a = ap.parse_args(argv)
    if a.chunk < 1 or a.positions < 1:
        ap.error("--chunk and --positions must be >= 1")
    for _, path in a.ckpts:
        if not (Path(path) / "config.json").is_file():
            print(f"error: {path}: no config.json (not a checkpoint folder)", file=sys.stderr)
            return 2
    if "exllamav3" in a.sides and not a.device.startswith("cuda"):
        print("error: exllamav3 needs --device cuda (use --sides ours on the CPU)", file=sys.stderr)
        return 2
    rows = []
    t0 = time.perf_counter()
    for name, path in a.ckpts:
        rows += run_checkpoint(name, path, a)
    print(f"\nLong-context correctness: KL(exllamav3 || ours) at {a.positions} sampled positions per prompt, "
          f"prefill in {a.chunk}-token chunks, seed {a.seed} ({time.perf_counter() - t0:.0f} s)\n")
    print(format_table(rows))
    if a.json is not None:
        doc = {"settings": {k: v for k, v in vars(a).items() if k not in ("json",)}, "rows": rows}
        doc["settings"]["ckpts"] = [list(c) for c in a.ckpts]
        a.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
