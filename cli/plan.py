"""exl3tools plan: will it fit, per GPU, from headers only."""

from __future__ import annotations

import click
from exl3tools.cli._output import console, emit_json
from rich.table import Table

from exl3tools.plan import DEFAULT_MAX_NUM_SEQS, fmt_bytes
from exl3tools.text import for_console


@click.command("plan")
@click.argument("path")
@click.option("--tp", type=click.IntRange(1, 256), default=1, show_default=True, help="Tensor-parallel ranks (one GPU each).")
@click.option("--moe", type=click.Choice(["tp", "ep"]), default="tp", show_default=True, help="How experts are cut over ranks.")
@click.option("--gpu-memory", default=None, help="Memory of one GPU: 141GiB, 80GB, 24000MiB, or bytes.")
@click.option("--gpu", "gpu_name", default=None, help="A GPU by name instead (h200, h100, a100-80g, l40s, rtx4090, ...).")
@click.option("--max-model-len", type=click.IntRange(1, None), default=None, help="Refuse unless the KV cache holds this many tokens.")
@click.option("--max-num-seqs", type=click.IntRange(1, None), default=DEFAULT_MAX_NUM_SEQS, show_default=True)
@click.option("--max-prefill-tokens", "--max-num-batched-tokens", "batched", type=click.IntRange(1, None),
              default=2048, show_default=True, help="Tokens of the largest eager step (activation estimate).")
@click.option("--gpu-memory-utilization", "util", type=click.FloatRange(0, 1, min_open=True), default=0.9, show_default=True)
@click.option("--block-size", type=click.Choice(["8", "16", "32", "64"]), default="16", show_default=True)
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "bf16", "fp16", "fp32"]), default="auto", show_default=True,
              help="KV-cache element type (auto: bf16 on CUDA for GQA K/V, fp32 for MLA's latent cache).")
@click.option("--json", "as_json", is_flag=True, help="Emit one JSON document (schemas/plan.v1.json).")
def plan_cmd(path: str, tp: int, moe: str, gpu_memory: str | None, gpu_name: str | None, max_model_len: int | None,
             max_num_seqs: int, batched: int, util: float, block_size: str, kv_cache_dtype: str, as_json: bool) -> None:
    """Per GPU: weight bytes, KV bytes per token, scratch, the KV tokens that fit and the longest
    context, from safetensors headers only. Exits 3 with one line when it does not fit.

    \b
    exl3tools plan ./GLM-4.5-Air-exl3 --gpu h200
    exl3tools plan ./GLM-4.5-Air-exl3 --tp 2 --gpu-memory 80GiB --max-model-len 131072
    exl3tools plan turboderp/GLM-4.5-Air-exl3@3.0bpw --gpu h200 --json
    """
    from exl3tools.errors import UsageError
    from exl3tools.hub import open_source
    from exl3tools.plan import gpu_bytes, parse_bytes, plan_memory

    if (gpu_memory is None) == (gpu_name is None):
        raise UsageError("give one of --gpu-memory SIZE or --gpu NAME")
    total = parse_bytes(gpu_memory) if gpu_memory else gpu_bytes(gpu_name)
    label = gpu_name.lower() if gpu_name else f"GPU of {gpu_memory.strip()}"
    ck, _ = open_source(path)
    p = plan_memory(ck, gpu=label, gpu_total=total, tp=tp, moe=moe, util=util, block_size=int(block_size),
                    kv_dtype=kv_cache_dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    batched_tokens=batched)
    if as_json:
        emit_json(p.to_json())
    else:
        t = Table(title=for_console(f"{p.path}  ({p.architecture}) on {p.gpu}, {fmt_bytes(p.gpu_bytes)} x {p.tp}"))
        for c in ("rank", "weights", "scratch", "KV B/token", "KV budget", "KV tokens"):
            t.add_column(c, justify="right")
        for r in p.ranks:
            t.add_row(str(r.rank), fmt_bytes(r.weight_bytes), fmt_bytes(r.scratch_bytes), str(r.kv_bytes_per_token),
                      fmt_bytes(max(r.kv_budget_bytes, 0)), str(r.kv_tokens))
        console.print(t)
        console.print(f"KV tokens {p.kv_tokens}, longest context {p.max_context} "
                      f"(model {p.model_max_context}); util {p.gpu_memory_utilization}, block {p.block_size}, "
                      f"kv dtype {p.kv_cache_dtype}")
    p.raise_unless_fits()
