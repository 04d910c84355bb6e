"""exl3tools normalize: canonical tensor names and layout (docs/normalize.md)."""

from __future__ import annotations

import click
from exl3tools.cli._output import byte_bar, console, emit_json, status

from exl3tools.text import for_console


@click.command("normalize")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Emit the plan as JSON.")
def normalize_cmd(src: str, dst: str, dry_run: bool, as_json: bool) -> None:
    """Rewrite SRC into DST with canonical names (gate/up/down_proj, MTP at model.layers.L, suh/svh,
    per-linear markers, one index). Unchanged tensors are copied byte for byte; idempotent.

    \b
    exl3tools normalize ./foreign-exl3 ./model-normalized --dry-run
    """

    from exl3tools.checkpoint import Checkpoint
    from exl3tools.normalize import apply_normalize, plan_normalize

    ck = Checkpoint.open(src)
    plan = plan_normalize(ck)
    if dry_run or as_json:
        if as_json:
            emit_json(plan.to_json())
        else:
            console.print(f"[bold]normalize plan[/] for {for_console(src)}: "
                          + ("nothing to change (already normalized)" if plan.is_noop else f"{len(plan.actions)} change(s)"))
            for a in plan.actions:
                console.print(f"  {for_console(a)}", soft_wrap=True)
        if dry_run:
            return
    total = sum(t.nbytes for _, _, ts in plan.shards for t in ts)
    prog, advance = byte_bar(total, "normalize")
    with prog:
        apply_normalize(ck, plan, dst, progress=advance)
    status(f"wrote {dst} ({len(plan.actions)} change(s))")
