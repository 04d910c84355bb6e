"""exl3tools rank-slice: cut an EXL3 checkpoint into per-GPU shard sets (docs/rank-slice.md)."""

from __future__ import annotations

from pathlib import Path

import click
from exl3tools.cli._output import byte_bar, console, emit_json, status, warn

from exl3tools.text import for_console


@click.command("rank-slice")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--tp", type=click.IntRange(1, 256), required=True, help="Number of tensor-parallel ranks.")
@click.option("--moe", type=click.Choice(["tp", "ep"]), default="tp", show_default=True,
              help="Routed experts: split each expert's intermediate (tp) or give whole experts to ranks (ep).")
@click.option("--layout", type=click.Choice(["ranks", "vllm-hybrid"]), default="ranks", show_default=True,
              help="ranks: DST/rank-r-of-N/ directories; vllm-hybrid: one dir with .rank{r}. expert names.")
@click.option("--dry-run", is_flag=True, help="Print the plan (every module's cut) and write nothing.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run; files whose hashes match are kept.")
@click.option("--threads", type=click.IntRange(1, 64), default=None, help="Parallel shard workers.")
@click.option("--json", "as_json", is_flag=True, help="Emit the plan (with --dry-run) or the result as JSON.")
def rank_slice_cmd(src: str, dst: str, tp: int, moe: str, layout: str, dry_run: bool, resume: bool,
                   threads: int | None, as_json: bool) -> None:
    """Cut SRC into per-rank shards for --tp N at 128-channel boundaries: lossless, no requantization.

    \b
    exl3tools rank-slice ./GLM-5-exl3 ./GLM-5-tp4 --tp 4
    exl3tools rank-slice ./GLM-5-exl3 ./GLM-5-tp4 --tp 4 --moe ep --dry-run
    exl3tools verify ./GLM-5-exl3 ./GLM-5-tp4
    """
    from exl3tools.checkpoint import Checkpoint
    from exl3tools.slicing import check_destination, plan_rank_slices, write_rank_shards

    ck = Checkpoint.open(src)
    plan = plan_rank_slices(ck, tp, moe, layout)
    if dry_run:
        if as_json:
            emit_json(plan.to_json())
            return
        s = plan.summary()
        console.print(f"[bold]rank-slice plan[/]  tp={tp} moe={moe} layout={layout}  {s['plan_fingerprint']}")
        for c in plan.cuts:
            console.print(f"[bold]rank {c['rank']}[/]")
            for a, e in c["attention"].items():
                console.print(f"  {for_console(a)}: {for_console(_fmt(e))}", soft_wrap=True)
            for m, e in c["modules"].items():
                console.print(f"  {for_console(m)}: {for_console(_fmt(e))}", soft_wrap=True)
        for o in s["outputs"]:
            console.print(f"{o['dir']}: {o['tensors']} tensors, {o['bytes'] / 1e9:.3f} GB")
        for n in plan.notes:
            console.print(f"note: {for_console(n)}")
        return
    check_destination(Path(dst), resume, ck.root)
    for n in plan.notes:
        warn(n)
    total = sum(t.nbytes for sp in plan.shards for outs in sp.outputs for t in outs)
    dequant = None
    if layout == "vllm-hybrid":
        from exl3tools.slicing import dequantize_to_writer as dequant
    prog, advance = byte_bar(total, f"rank-slice tp={tp}")
    with prog:
        man = write_rank_shards(ck, plan, dst, resume=resume, threads=threads, progress=advance, dequant=dequant)
    if as_json:
        emit_json({"dst": dst, "plan_fingerprint": man.plan_fingerprint, "files": len(man.files),
                   "bytes": sum(f.size for f in man.files.values())})
    else:
        status(f"wrote {len(man.files)} files ({sum(f.size for f in man.files.values()) / 1e9:.3f} GB) "
               f"under {dst}; manifest.json last")


def _fmt(e: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in e.items())
