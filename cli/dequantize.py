"""exl3tools dequantize: decode every EXL3 linear into a plain Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

import click
from exl3tools.cli._output import byte_progress, console, emit_json


@click.command("dequantize")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--tensor", "tensors", multiple=True, help="Only this linear or tensor (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")
@click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint in DST.")
@click.option("--device", default="auto", show_default=True,
              help="Where to decode: auto (cuda when there is one), cpu, cuda, cuda:N. Same bytes either way.")
@click.option("--json", "as_json", is_flag=True, help="Emit the plan/result as JSON.")
def dequantize_cmd(src: Path, dst: Path, dtype: str, tensors: tuple[str, ...], dry_run: bool, overwrite: bool,
                   device: str, as_json: bool) -> None:
    """Write a plain HF checkpoint: each EXL3 linear becomes P.weight (out, in), cropped to real dims.

    \b
    exl3tools dequantize ./model-exl3 ./model-bf16
    exl3tools dequantize ./model-exl3 ./one --tensor model.layers.0.mlp.down_proj --dtype fp32
    exl3tools dequantize ./model-exl3 ./model-bf16 --device cpu
    """
    from exl3tools.checkpoint import Checkpoint
    from exl3tools.dequantize import apply_dequantize, plan_dequantize

    ck = Checkpoint.open(src)
    plan = plan_dequantize(ck, dst, dtype, list(tensors) or None)
    if dry_run:
        if as_json:
            emit_json({"dry_run": True, "shards": [{"file": f, "tensors": [t.name for t in ts]} for f, ts in plan.shards],
                       "total_bytes": plan.total_bytes})
        else:
            for line in plan.describe():
                console.print(line)
        return
    from exl3tools.cli._device import decode_device, decoder

    device = decode_device(device)
    gpu = decoder(device)
    with byte_progress("dequantize", disable=as_json) as bar:
        task = bar.add_task("", total=plan.total_bytes)
        out = apply_dequantize(plan, ck, overwrite=overwrite, progress=lambda n: bar.advance(task, n), gpu=gpu)
    if as_json:
        emit_json({"dst": str(out), "shards": len(plan.shards), "total_bytes": plan.total_bytes, "device": device})
    else:
        console.print(f"wrote {out} ({len(plan.shards)} shards, {plan.total_bytes / 1e6:.1f} MB, {dtype}, decoded on {device})")
