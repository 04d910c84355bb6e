"""exl3tools eval: perplexity over a text file, and KL against a reference model."""

from __future__ import annotations

from pathlib import Path

import click
from exl3tools.cli._device import run_options
from exl3tools.cli._output import console, emit_json, err_console

from exl3tools.text import for_console


@click.command("eval")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--text", "text_file", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="UTF-8 text file, encoded with PATH's tokenizer.json.")
@click.option("--reference", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Reference model (EXL3, or a plain HF checkpoint of the same model): KL(reference || PATH).")
@click.option("--window", type=click.IntRange(2, None), default=2048, show_default=True,
              help="Tokens per window (capped at the runner's longest context).")
@click.option("--stride", type=click.IntRange(1, None), default=None, help="Window step (default: window / 2).")
@click.option("--add-bos/--no-add-bos", default=True, show_default=True, help="Prepend BOS to the text.")
@run_options
@click.option("--json", "as_json", is_flag=True, help="Emit one JSON document (schemas/eval.v1.json).")
def eval_cmd(path: Path, text_file: Path, reference: Path | None, window: int, stride: int | None, add_bos: bool,
             device: str, backend: str, as_json: bool) -> None:
    """Perplexity of PATH over a text file with a sliding window, and with --reference the mean and
    percentile KL divergence of PATH's next-token distribution from the reference's.

    \b
    exl3tools eval ./model-exl3 --text wiki.test.txt
    exl3tools eval ./model-exl3 --text wiki.test.txt --reference ./model-bf16 --json
    """
    from exl3tools.cli._device import run_device
    from rich.progress import Progress

    from exl3tools.errors import UsageError
    from exl3tools.runtime.evaluate import check_tokens, evaluate
    from exl3tools.runtime.runner import load_runner

    device = run_device(device)
    if not text_file.is_file():
        raise UsageError(f"{text_file}: no such text file")
    try:
        text = text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{text_file}: not UTF-8 text (byte {exc.start})") from None
    opts = dict(device=device, backend=backend, decode="eager", max_num_seqs=1)
    with load_runner(path, **opts) as runner:
        if runner.tokenizer is None:
            raise UsageError(f"{path}: no tokenizer.json to encode {text_file}")
        ids = runner.tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos and runner.bos_token_id is not None and ids[:1] != [runner.bos_token_id]:
            ids = [runner.bos_token_id] + ids
        check_tokens(ids, str(text_file))     # before the progress bar: the error stays one line
        ref = load_runner(reference, **opts) if reference is not None else None
        try:
            with Progress(console=err_console, transient=True, disable=as_json) as prog:
                task = prog.add_task("windows", total=None)
                res = evaluate(runner, ids, window=window, stride=stride or max(window // 2, 1), reference=ref,
                               progress=lambda d, t: prog.update(task, completed=d, total=t), path=str(path),
                               text=str(text_file), reference_path=None if reference is None else str(reference))
        finally:
            if ref is not None:
                ref.close()
    if as_json:
        emit_json(res.to_json())
        return
    console.print(f"{for_console(res.path)}: perplexity {res.perplexity:.4f} over {res.scored} tokens "
                  f"({res.windows} windows of {res.window}, stride {res.stride})")
    if res.kl is not None:
        console.print(f"reference {for_console(res.reference or '')}: perplexity {res.reference_perplexity:.4f}")
        console.print("KL(reference || model): " + ", ".join(f"{k} {v:.6g}" for k, v in res.kl.items()))
