"""exl3tools verify: check that a rank-sliced output reassembles to its source, byte for byte."""

from __future__ import annotations

from pathlib import Path

import click
from exl3tools.cli._output import byte_bar, console, emit_json


@click.command("verify")
@click.argument("src", type=click.Path())
@click.argument("sliced", type=click.Path())
@click.option("--decode-samples", type=click.IntRange(0, 10000), default=4, show_default=True,
              help="Random linears per rank whose random 128x128 block is decoded from slice and source.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--no-hash", is_flag=True, help="Skip re-hashing output files (sizes are still checked).")
@click.option("--json", "as_json", is_flag=True, help="Emit the report as JSON.")
def verify_cmd(src: str, sliced: str, decode_samples: int, seed: int, no_hash: bool, as_json: bool) -> None:
    """Verify SLICED (a rank-slice output) against SRC: exit 0 if identical, 1 if not or incomplete.

    \b
    exl3tools verify ./GLM-5-exl3 ./GLM-5-tp4
    exl3tools verify org/GLM-5-exl3 ./GLM-5-tp4     (SRC a Hub repo: its ranges are fetched afresh)
    """

    from exl3tools.checkpoint.manifest import load_manifest
    from exl3tools.hub import looks_like_repo_id
    from exl3tools.slicing import verify_sliced

    man = load_manifest(sliced)
    total = sum(r.tensor_bytes for r in man.ranks)
    prog, advance = byte_bar(total, "verify")
    verify = verify_sliced
    if not Path(src).exists() and looks_like_repo_id(src.removeprefix("hf://")):
        from exl3tools.hub_slice import verify_remote as verify  # fetches the source ranges afresh
    with prog:
        rep = verify(src, sliced, decode_samples=decode_samples, seed=seed, hash_files=not no_hash,
                     progress=advance)
    if as_json:
        emit_json(rep.to_json())
        return
    console.print(f"[green]ok[/]: {rep.tensors} tensors ({rep.bytes_compared / 1e9:.3f} GB) byte-identical, "
                  f"{rep.files_hashed} files hashed, {rep.decode_blocks} decoded blocks equal")
