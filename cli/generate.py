"""exl3tools generate: run a prompt through the runtime and stream the completion."""

from __future__ import annotations

import time
from pathlib import Path

import click
from exl3tools.cli._device import run_options

from exl3tools.errors import UsageError


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UsageError(f"--token-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--token-ids is empty")
    return ids


@click.command("generate")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True,
              help="Tensor-parallel ranks (spawns this many processes; PATH may be a rank-slice output).")
@click.option("--prompt", default=None, help="Prompt text (encoded with the model's tokenizer.json).")
@click.option("--token-ids", default=None, help="Prompt as token ids, e.g. 1,2,3 (instead of --prompt).")
@click.option("--max-tokens", type=click.IntRange(0), default=64, show_default=True)
@click.option("--temperature", type=float, default=None,
              help="0 = greedy. Default: generation_config.json's temperature, else 0.")
@click.option("--top-k", type=click.IntRange(0), default=None,
              help="0 = off. Default: generation_config.json's top_k, else 0.")
@click.option("--top-p", type=float, default=None,
              help="Default: generation_config.json's top_p, else 1.")
@click.option("--seed", type=int, default=None, help="Sampling seed (reproducible runs).")
@click.option("--add-bos/--no-add-bos", default=False, show_default=True,
              help="Prepend the BOS token to a --prompt that does not start with it.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@click.option("--logits-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write prompt logits (every position) and per-step logits as safetensors.")
@run_options
@click.option("--moe", type=click.Choice(["tp", "ep"]), default="tp", show_default=True,
              help="MoE cut when running an unsliced checkpoint with --tp > 1.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="Decode steps as CUDA graphs over the paged KV cache (default: on with a CUDA device "
                   "for GQA models).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON result instead of streaming text.")
@click.option("--mtp", type=click.IntRange(0, 8), default=0, show_default=True,
              help="Speculative decoding with the model's MTP head, N draft tokens per step: greedy by default "
                   "(exactly the plain greedy tokens); with --temperature, rejection sampling keeps the model's "
                   "distribution.")
def generate_cmd(path: Path, tp: int, prompt: str | None, token_ids: str | None, max_tokens: int,
                 temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None,
                 add_bos: bool, ignore_eos: bool, logits_out: Path | None, device: str, backend: str,
                 moe: str, cuda_graphs: bool | None, as_json: bool, mtp: int) -> None:
    """Generate a completion for a prompt with the CPU/GPU runtime.

    \b
    exl3tools generate ./model --prompt "Hello" --max-tokens 32
    exl3tools generate ./model-tp2 --tp 2 --token-ids 1,77,300 --logits-out out.safetensors
    exl3tools generate org/model-exl3 --tp 2 --prompt "Hi"   (rank-sliced from the Hub into its cache)
    exl3tools generate ./model --prompt "Once" --temperature 0.8 --top-p 0.9 --seed 7
    """
    from exl3tools.cli._device import run_device
    from exl3tools.cli._output import emit_json, status
    from exl3tools.cli._runtime import LoadProgress, check_output_file, preflight_plan

    from exl3tools.hub import looks_like_repo_id
    from exl3tools.runtime.runner import load_runner
    from exl3tools.runtime.sampling import make_generator, sample
    from exl3tools.server.limits import sampling_value_problem

    if (prompt is None) == (token_ids is None):
        raise UsageError("give exactly one of --prompt or --token-ids")
    if mtp and logits_out is not None:
        raise UsageError("--mtp and --logits-out do not go together (drafted steps keep no prompt logits)")
    for problem in (sampling_value_problem("--temperature", temperature, upper=float("inf"), zero_ok=True),
                    sampling_value_problem("--top-p", top_p, upper=1.0, zero_ok=False)):
        if problem:
            raise UsageError(problem)
    ids = _token_ids(token_ids) if token_ids is not None else None
    device = run_device(device, tp)  # all before loading: a bad option must not cost a model load
    check_output_file(logits_out, "--logits-out")
    if tp > 1 and not path.exists() and looks_like_repo_id(str(path)):  # slice from the Hub, by ranges
        from exl3tools.hub_slice import ensure_slices

        path = ensure_slices(str(path), tp, moe)
    else:
        preflight_plan(path, device=device, tp=tp, moe=moe, max_num_seqs=1, batched_tokens=512)  # docs/plan.md
    t0 = time.perf_counter()
    with LoadProgress():
        runner = load_runner(path, tp=tp, device=device, backend=backend, moe=moe,
                             decode="eager" if mtp else {None: None, True: "graphs", False: "eager"}[cuda_graphs],
                             max_num_seqs=1, speculative_tokens=mtp)
    if runner is None:  # a torchrun worker rank: it served rank 0 until the end
        return
    with runner:
        t_load = time.perf_counter() - t0
        d = {} if mtp else runner.generation_defaults   # options left out: the model's defaults
        temperature = d.get("temperature", 0.0) if temperature is None else temperature
        top_k = d.get("top_k", 0) if top_k is None else top_k
        top_p = d.get("top_p", 1.0) if top_p is None else top_p
        if ids is None:
            if runner.tokenizer is None:
                raise UsageError(f"{path}: no tokenizer.json; use --token-ids")
            ids = runner.tokenizer.encode(prompt).ids
            if add_bos and runner.bos_token_id is not None and (not ids or ids[0] != runner.bos_token_id):
                ids = [runner.bos_token_id] + ids
        if not ids:
            raise UsageError("the prompt encodes to no tokens")
        if len(ids) + max_tokens > runner.max_context:  # up front, not after generating
            raise UsageError(f"the prompt ({len(ids)} tokens) plus --max-tokens {max_tokens} exceeds "
                             f"the model's context of {runner.max_context} tokens")
        if mtp:  # runtime/mtp.py: speculative decoding (greedy: the plain greedy tokens)
            from exl3tools.runtime.mtp import generate_cli

            return generate_cli(runner, ids, max_tokens, mtp, ignore_eos=ignore_eos, as_json=as_json,
                                t_load=t_load, tp=tp, temperature=temperature, top_k=top_k, top_p=top_p,
                                generator=make_generator(seed, device=runner.model.embed.device)
                                if temperature > 0 else None)
        gen = make_generator(seed)
        runner.add_sequence("cli")
        t1 = time.perf_counter()
        prompt_logits = runner.step([("cli", ids)], all_logits=logits_out is not None)
        t_prefill = time.perf_counter() - t1
        row = prompt_logits[-1]
        out_ids: list[int] = []
        step_logits = []
        shown = ""
        t2 = time.perf_counter()
        for i in range(max_tokens):
            if logits_out is not None:
                step_logits.append(row.clone())
            tok = sample(row, temperature, top_k, top_p, gen)
            out_ids.append(tok)
            if not as_json and runner.tokenizer is not None:
                text = runner.tokenizer.decode(out_ids)
                if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    click.echo(text[len(shown):], nl=False)
                    shown = text
            if tok in runner.eos_token_ids and not ignore_eos:
                break
            if i + 1 < max_tokens:
                row = runner.step([("cli", [tok])])[0]
        t_decode = time.perf_counter() - t2
        if logits_out is not None:
            _write_logits(logits_out, ids, prompt_logits, out_ids, step_logits)
        text = runner.tokenizer.decode(out_ids) if runner.tokenizer is not None else None
        stats = {"load_s": round(t_load, 3), "prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                 "prefill_tok_s": round(len(ids) / t_prefill, 2) if t_prefill else None,
                 "decode_tok_s": round(len(out_ids) / t_decode, 2) if t_decode and out_ids else None}
        if as_json:
            emit_json({"model": runner.model_name, "tp": tp, "prompt_ids": ids, "completion_ids": out_ids,
                       "text": text, **stats})
        else:
            if runner.tokenizer is None:
                click.echo(",".join(map(str, out_ids)), nl=False)
            click.echo()
            status(f"{len(ids)} prompt tokens, {len(out_ids)} generated; prefill {stats['prefill_tok_s']} tok/s, "
                   f"decode {stats['decode_tok_s']} tok/s, load {t_load:.1f} s, on {device}")


def _write_logits(dst: Path, prompt_ids: list[int], prompt_logits, out_ids: list[int], step_logits: list) -> None:
    """prompt_tokens I64 [n], prompt_logits F32 [n, vocab] (logits after each prompt position),
    tokens I64 [steps], step_logits F32 [steps, vocab] (the row each generated token came from)."""
    import os

    import torch
    from safetensors.torch import save_file

    vocab = prompt_logits.shape[-1]
    tensors = {
        "prompt_tokens": torch.tensor(prompt_ids, dtype=torch.int64),
        "prompt_logits": prompt_logits.float().contiguous(),
        "tokens": torch.tensor(out_ids, dtype=torch.int64),
        "step_logits": (torch.stack(step_logits) if step_logits else torch.empty(0, vocab)).float().contiguous(),
    }
    tmp = dst.with_name(f".{dst.name}.tmp")
    save_file(tensors, str(tmp), metadata={"producer": "exl3tools generate"})
    os.replace(tmp, dst)
