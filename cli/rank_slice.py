"""exl3tools rank-slice: cut an EXL3 checkpoint into per-GPU shard sets (docs/rank-slice.md)."""

from __future__ import annotations

from pathlib import Path

import click
from exl3tools.cli._output import byte_bar, console, emit_json, status, warn

from exl3tools.errors import UsageError
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
@click.option("--ranks", default=None, help="Only these ranks, e.g. 0,1 (default: all). From a Hub repo, only "
              "their bytes are fetched.")
@click.option("--merge-gap", type=click.IntRange(0), default=0, show_default=True,
              help="Hub repo: fetch ranges closer than this many bytes as one request (fewer requests, more bytes).")
@click.option("--parallel", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Hub repo: concurrent range requests.")
@click.option("--keep-cache", is_flag=True, help="Hub repo: keep the fetched ranges in $HF_HOME/exl3tools/ranges.")
def rank_slice_cmd(src: str, dst: str, tp: int, moe: str, layout: str, dry_run: bool, resume: bool,
                   threads: int | None, as_json: bool, ranks: str | None, merge_gap: int, parallel: int,
                   keep_cache: bool) -> None:
    """Cut SRC into per-rank shards for --tp N at 128-channel boundaries: lossless, no requantization.

    SRC is a directory or a Hugging Face repo id (REPO_ID[@REVISION]); from a repo, the plan comes from
    the remote headers and only the byte ranges of the selected ranks are downloaded.

    \b
    exl3tools rank-slice ./GLM-5-exl3 ./GLM-5-tp4 --tp 4
    exl3tools rank-slice ./GLM-5-exl3 ./GLM-5-tp4 --tp 4 --moe ep --dry-run
    exl3tools rank-slice org/GLM-5-exl3@main ./GLM-5-tp4 --tp 4 --ranks 0,1
    exl3tools verify ./GLM-5-exl3 ./GLM-5-tp4
    """
    from exl3tools.checkpoint import Checkpoint
    from exl3tools.hub import looks_like_repo_id
    from exl3tools.hub_slice import parse_ranks
    from exl3tools.slicing import check_destination, plan_rank_slices, write_rank_shards

    selected = parse_ranks(ranks, tp)
    if not Path(src).exists() and looks_like_repo_id(src.removeprefix("hf://")):
        if layout != "ranks":
            raise UsageError("--layout vllm-hybrid needs a local SRC (from a Hub repo only --layout ranks)")
        return _from_hub(src, Path(dst), tp, moe, selected, dry_run=dry_run, resume=resume, as_json=as_json,
                         gap=merge_gap, parallel=parallel, keep_cache=keep_cache)
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
    if ranks is not None:
        total = sum(t.nbytes for sp in plan.shards for r in selected for t in sp.outputs[r])
    prog, advance = byte_bar(total, f"rank-slice tp={tp}")
    with prog:
        man = write_rank_shards(ck, plan, dst, resume=resume, threads=threads, progress=advance, dequant=dequant,
                                ranks=selected if ranks is not None else None)
    _done(man, dst, as_json)


def _done(man, dst: str | Path, as_json: bool, **extra) -> None:
    if as_json:
        emit_json({"dst": str(dst), "plan_fingerprint": man.plan_fingerprint, "files": len(man.files),
                   "bytes": sum(f.size for f in man.files.values()), **extra})
    else:
        status(f"wrote {len(man.files)} files ({sum(f.size for f in man.files.values()) / 1e9:.3f} GB) "
               f"under {dst}; manifest.json last")


def _from_hub(spec: str, dst: Path, tp: int, moe: str, ranks: list[int], *, dry_run: bool, resume: bool,
              as_json: bool, gap: int, parallel: int, keep_cache: bool) -> None:
    """Plan from the repo's headers; fetch only the selected ranks' byte ranges; write like the local path."""
    from exl3tools.hub_slice import (
        fetch_ranges,
        fetch_summary,
        needed_ranges,
        plan_outputs,
        remote_plan,
        write_from_mirror,
    )
    from exl3tools.slicing import check_destination

    if not dry_run:
        check_destination(dst, resume)
    ck, src, plan = remote_plan(spec, tp, moe)
    s = fetch_summary(plan, ck, ranks, gap)
    if dry_run:
        if as_json:
            emit_json({**plan.to_json(), "repo": src.repo, "revision": src.commit, "fetch": s})
            return
        console.print(f"[bold]rank-slice plan[/]  hf://{for_console(src.repo)}@{src.commit}  tp={tp} moe={moe}  "
                      f"{plan.fingerprint}")
        for r in s["ranks"]:
            console.print(f"{r['dir']}: fetch {r['bytes']:,} bytes in {r['ranges']:,} ranges "
                          f"({r['tensor_bytes']:,} tensor bytes)")
        console.print(f"this node (ranks {','.join(map(str, ranks))}): fetch {s['fetch_bytes']:,} of "
                      f"{s['repo_bytes']:,} bytes ({100 * s['fraction']:.1f}%) in {s['fetch_ranges']:,} requests")
        for n in plan.notes:
            console.print(f"note: {for_console(n)}")
        return
    for n in plan.notes:
        warn(n)
    need = needed_ranges(ck, plan_outputs(plan, ranks), gap)
    fprog, fadvance = byte_bar(s["fetch_bytes"], f"fetch hf://{src.repo}")
    with fprog:
        fetch_ranges(src, need, parallel=parallel, progress=fadvance)
    wprog, wadvance = byte_bar(sum(r["tensor_bytes"] for r in s["ranks"]), f"rank-slice tp={tp}")
    with wprog:
        man = write_from_mirror(ck, src, plan, dst, ranks, resume=resume, keep_cache=keep_cache, progress=wadvance)
    _done(man, dst, as_json, repo=src.repo, revision=src.commit, fetched=s["fetch_bytes"])


def _fmt(e: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in e.items())
