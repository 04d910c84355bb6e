"""exl3tools diff: per linear and per layer error between two checkpoints, worst first."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click
from exl3tools.cli._output import console, emit_json, err_console
from rich.table import Table

from exl3tools.text import for_console


def _fmt(r) -> list[str]:
    sqnr = "inf" if r.sqnr_db is None else f"{r.sqnr_db:.2f}"
    return [for_console(r.name), f"{r.rel_err:.6f}", sqnr, f"{r.cosine:.6f}"]


@click.command("diff")
@click.argument("a", type=click.Path(exists=True, file_okay=False))
@click.argument("b", type=click.Path(exists=True, file_okay=False))
@click.option("--top", type=click.IntRange(1, None), default=20, show_default=True, help="Linears shown in the table.")
@click.option("--prompt", default=None, help="Also run both models on this text (A's tokenizer): per-layer "
              "hidden-state cosine and final-logit KL.")
@click.option("--token-ids", default=None, help="The same with token ids, e.g. 1,77,300.")
@click.option("--device", default="auto", show_default=True,
              help="Where --prompt/--token-ids run: auto (cuda when there is a GPU, else cpu), cpu, cuda, cuda:N.")
@click.option("--json", "as_json", is_flag=True, help="Emit one JSON document (schemas/diff.v1.json), every linear.")
def diff_cmd(a: str, b: str, top: int, prompt: str | None, token_ids: str | None, device: str, as_json: bool) -> None:
    """Relative error, SQNR and cosine of A's decoded linears against B's (the reference), per
    linear and per layer, worst first. A and B: EXL3 checkpoints, or one EXL3 and one plain HF
    (bf16/fp16/fp32) checkpoint of the same model. One linear at a time, in bounded memory.

    \b
    exl3tools diff ./model-3.0bpw ./model-4.0bpw
    exl3tools diff ./model-exl3 ./model-bf16 --json > diff.json
    exl3tools diff ./model-exl3 ./model-bf16 --token-ids 1,77,300,5
    """
    from rich.progress import Progress

    from exl3tools.checkpoint import Checkpoint
    from exl3tools.diff import diff_checkpoints

    ids = _prompt_ids(a, prompt, token_ids) if prompt is not None or token_ids is not None else None
    cka, ckb = Checkpoint.open(a), Checkpoint.open(b)
    with Progress(console=err_console, transient=True, disable=as_json) as prog:
        task = prog.add_task("decoding linears", total=None)
        rep = diff_checkpoints(cka, ckb, progress=lambda done, total: prog.update(task, completed=done, total=total))
    if ids is not None:
        rep = replace(rep, activations=_activations(a, b, ids, device))
    if as_json:
        emit_json(rep.to_json())
        return
    for title, rows in (("layers, worst first", rep.layers), (f"linears, worst {min(top, len(rep.linears))} of "
                                                             f"{len(rep.linears)}", rep.linears[:top])):
        t = Table(title=title)
        for c in ("name", "rel err", "SQNR dB", "cosine"):
            t.add_column(c, justify="left" if c == "name" else "right")
        for r in rows:
            t.add_row(*_fmt(r))
        console.print(t)
    if rep.activations is not None:
        act = rep.activations
        t = Table(title=f"hidden states over {act['tokens']} tokens, A vs B")
        for c in ("layer", "cosine mean", "cosine min"):
            t.add_column(c, justify="right")
        for r in act["layers"]:
            t.add_row(str(r["layer"]), f"{r['cosine_mean']:.6f}", f"{r['cosine_min']:.6f}")
        console.print(t)
        lg = act["logits"]
        console.print(f"final logits: KL(B || A) mean {lg['kl_mean']:.6g}, max {lg['kl_max']:.6g}, "
                      f"top-1 agree {lg['top1_agree']:.3f}")
    for side, names in (("A", rep.missing_in_a), ("B", rep.missing_in_b)):
        if names:
            console.print(f"{len(names)} linears missing in {side}: {for_console(', '.join(names[:5]))}"
                          + (" ..." if len(names) > 5 else ""))


def _prompt_ids(a: str, prompt: str | None, token_ids: str | None) -> list[int]:
    """Checked before any weight is decoded: a bad option must not cost the whole diff."""
    from exl3tools.cli.generate import _token_ids

    from exl3tools.errors import UsageError

    if prompt is not None and token_ids is not None:
        raise UsageError("give one of --prompt or --token-ids")
    if token_ids is not None:
        return _token_ids(token_ids)
    from exl3tools.runtime.loader import load_tokenizer

    tok = load_tokenizer(Path(a) / "tokenizer.json")
    if tok is None:
        raise UsageError(f"{a}: no tokenizer.json to encode --prompt (use --token-ids)")
    return tok.encode(prompt, add_special_tokens=False).ids


def _activations(a: str, b: str, ids: list[int], device: str) -> dict:
    from exl3tools.cli._device import run_device

    from exl3tools.runtime.evaluate import activation_diff
    from exl3tools.runtime.runner import load_runner

    device = run_device(device)
    opts = dict(device=device, decode="eager", max_num_seqs=1, max_cache_tokens=len(ids))
    with load_runner(a, **opts) as ra, load_runner(b, **opts) as rb:
        return activation_diff(ra, rb, ids)
