"""exl3tools validate: a CI gate that catches broken EXL3 checkpoints before anything loads them."""

from __future__ import annotations

import click
from exl3tools.cli._output import byte_progress, console, emit_json, err_console


@click.command("validate")
@click.argument("path")
@click.option("--deep", is_flag=True, help="Read every byte: sha256 of every file, decode every linear, check every dense tensor.")
@click.option("--strict", is_flag=True, help="Warnings fail too (exit 1).")
@click.option("--json", "as_json", is_flag=True, help="Emit one JSON document with every finding.")
@click.option("--junit-xml", "junit", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write a JUnit XML report (one testcase per rule) to this file.")
@click.option("--sample-blocks", type=click.IntRange(0, 10_000_000), default=256, show_default=True,
              help="Sampled mode: how many linears get one 128x128 block decoded.")
@click.option("--device", default="auto", show_default=True,
              help="Where --deep decodes: auto (cuda when there is one), cpu, cuda, cuda:N. Same findings either way.")
def validate_cmd(path: str, deep: bool, strict: bool, as_json: bool, junit: str | None, sample_blocks: int,
                 device: str) -> None:
    """Check an EXL3 checkpoint (or a rank-slice output set / rank dir) and exit 0 if clean.

    Exit codes: 0 clean; 1 any error (any warning with --strict); 2 usage or I/O problem.
    Rules and codes: docs/validate.md.

    \b
    exl3tools validate ./GLM-4.5-Air-exl3
    exl3tools validate ./GLM-5-exl3 --deep --junit-xml validate.xml
    exl3tools validate ./out/tp4 --json
    exl3tools validate ./GLM-5-exl3 --deep --device cpu
    """
    from exl3tools.checkpoint.writer import write_atomic
    from exl3tools.validate import validate
    from exl3tools.validate.report import junit_xml, render

    gpu = None
    if deep:  # only --deep decodes whole linears; sampled mode never loads torch
        from exl3tools.cli._device import decode_device, decoder

        gpu = decoder(decode_device(device))
    progress = None
    bar = None
    if deep and not as_json and err_console.is_terminal:
        bar = byte_progress("validate --deep", transient=True)

        def progress(total: int, files: int):
            task = bar.add_task("read", total=total)
            return lambda n: bar.advance(task, n)
    elif deep and not as_json:
        def progress(total: int, files: int):  # not a terminal: one line, no bar
            err_console.print(f"validate --deep: reading {total / 1e9:.2f} GB in {files} files")
            return None

    if bar is not None:
        with bar:
            report = validate(path, deep=deep, sample_blocks=sample_blocks, progress=progress, gpu=gpu)
    else:
        report = validate(path, deep=deep, sample_blocks=sample_blocks, progress=progress, gpu=gpu)

    if junit:
        write_atomic(junit, junit_xml(report, strict=strict))
    if as_json:
        doc = report.to_json()
        doc["ok"] = report.ok(strict)
        doc["strict"] = strict
        emit_json(doc)
    else:
        render(report, console, strict=strict)
    raise SystemExit(report.exit_code(strict))
