"""exl3tools inspect: what is in a checkpoint."""

from __future__ import annotations

import click
from exl3tools.cli._output import console, emit_json, warn
from rich.table import Table

from exl3tools.text import for_console


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


@click.command("inspect")
@click.argument("path")
@click.option("--tp", type=click.IntRange(1, 256), default=None, help="Also estimate bytes per rank at this TP degree.")
@click.option("--tensor", "tensor", default=None, help="Show one EXL3 linear (prefix or tensor name) and its decoded weight stats.")
@click.option("--json", "as_json", is_flag=True, help="Emit one JSON document (schemas/inspect.v1.json).")
def inspect_cmd(path: str, tp: int | None, tensor: str | None, as_json: bool) -> None:
    """Show architecture, layers, experts, bits per tensor family, codebooks and sizes.

    PATH is a checkpoint directory or a Hugging Face repo id (owner/name[@revision]): read from
    the local cache when offline, else from safetensors headers only (no weights downloaded).

    \b
    exl3tools inspect ./GLM-4.5-Air-exl3 --tp 4
    exl3tools inspect ./GLM-4.5-Air-exl3 --tensor model.layers.3.mlp.experts.17.down_proj
    exl3tools inspect turboderp/GLM-4.5-Air-exl3@3.0bpw --json
    """
    from exl3tools.errors import UsageError
    from exl3tools.hub import open_source
    from exl3tools.inspect import inspect_tensor, summarize

    ck, source = open_source(path)
    if tensor:
        if source == "hub-headers":
            raise UsageError("--tensor decodes weights: download the checkpoint first (huggingface-cli download)")
        rep = inspect_tensor(ck, tensor)
        if as_json:
            emit_json(rep.to_json())
            return
        t = Table(title=f"{for_console(rep.prefix)}  ({rep.family})", show_header=False)
        t.add_row("padded (in, out)", f"({rep.k_padded}, {rep.n_padded})")
        t.add_row("real (in, out)", f"({rep.in_real}, {rep.out_real})")
        t.add_row("bits K", rep.bits)
        t.add_row("codebook", rep.codebook)
        for s, info in rep.tensors.items():
            t.add_row(f".{s}", f"{info['dtype']} {info['shape']}")
        for k, v in rep.stats.items():
            t.add_row(f"W {k}", "-" if v is None else f"{v:.6g}")
        console.print(t)
        return

    s = summarize(ck, tp=tp, source=source)
    if as_json:
        emit_json(s.to_json())
        return
    for msg in s.issues:
        warn(msg)
    head = Table(title=f"{for_console(s.path)}  \\[{s.source}]", show_header=False)
    head.add_row("architecture", for_console(f"{s.architecture} ({s.model_type})"))
    head.add_row("dims", for_console(", ".join(f"{k}={v}" for k, v in s.dims.items())))
    head.add_row("quantization", for_console(", ".join(f"{k}={v}" for k, v in s.quantization.items())) or "none (not EXL3)")
    head.add_row("layers", ", ".join(f"{n} {k}" for k, n in sorted(s.layers.items())))
    head.add_row("experts", f"routed={s.experts['routed']} shared={s.experts['shared']} top_k={s.experts['top_k']}"
                 f" present/layer={s.experts['present_per_moe_layer']}")
    head.add_row("codebooks", ", ".join(f"{k}: {v} linears" for k, v in sorted(s.codebooks.items())))
    head.add_row("storage bpw", ", ".join(f"{k}={v:.3f}" for k, v in s.storage_bpw.items() if v))
    head.add_row("totals", f"{s.totals['tensors']} tensors in {s.totals['files']} files, {_gb(s.totals['tensor_bytes'])}; "
                 f"{s.totals['exl3_linears']} EXL3 linears, {s.totals['exl3_weights'] / 1e6:.1f} M weights")
    if s.per_rank_bytes:
        r = s.per_rank_bytes
        head.add_row(f"per rank at tp={r['tp']}", f"~{_gb(r['bytes_per_rank'])} "
                     f"(split {_gb(r['split_bytes'])} / {r['tp']} + replicated {_gb(r['replicated_bytes'])})")
    console.print(head)
    bits = Table(title="bits per tensor family")
    for c in ("family", "K", "linears", "M weights"):
        bits.add_column(c, justify="right" if c != "family" else "left")
    for row in s.bits:
        bits.add_row(row.family, row.bits, str(row.linears), f"{row.weights / 1e6:.2f}")
    console.print(bits)
    layers = Table(title="layers")
    for c in ("layer", "kind", "attention", "routed experts", "shared"):
        layers.add_column(c)
    rows = s.layer_list
    shown = rows if len(rows) <= 12 else rows[:5] + [None] + rows[-5:]
    for row in shown:
        if row is None:
            layers.add_row("...", "", "", "", "")
            continue
        layers.add_row(str(row["index"]), row["kind"], row["attention"], str(row["experts"]), "yes" if row["shared_experts"] else "")
    console.print(layers)
