"""Decode paths written for CUDA that have not yet run on a GPU: off on CUDA until a GPU run has
checked them (tests/gpu, bench/gpu_all.sh), unless their switch is "1". On the CPU (the static step,
the Triton interpreter) the tests run them as they are; `bench/gpu_all.sh` turns them all on for
tests/gpu and serves and times them beside the defaults, so one device call checks and times both.
A switch leaves this table once its path has passed on a GPU and become the default; its variable
then stays as an opt-out ("0"): OPT_OUTS.
"""

from __future__ import annotations

import os

SWITCHES = {    # name -> variable: off on CUDA unless "1"
    # DSA's sparse decode graphs per block-table width (paged_decode.widths), not only the full one
    "dsa_widths": "EXL3TOOLS_DSA_WIDTHS",
    # the MTP head's cache in the block pool and its drafts as a fixed-shape step (PagedDecoder.draft)
    "mtp_paged": "EXL3TOOLS_MTP_PAGED",
}

# Former previews, on by default since an H200 run passed tests/gpu with them and timed `serve`
# faster (docs/gpu.md, 2026-12-01: 836 vs 541 tok/s at one stream): off only when "0"
OPT_OUTS = {
    "fused": "EXL3TOOLS_FUSED",            # Triton glue kernels in the GQA decode step (issue 15)
    "row_steps": "EXL3TOOLS_ROW_STEPS",    # several new tokens of one sequence as rows of the decode step
}


def switched_on(name: str) -> bool:
    """Whether the path ``name`` runs: a preview when asked for ("1"), a former one unless "0"."""
    if name in OPT_OUTS:
        return os.environ.get(OPT_OUTS[name]) != "0"
    return os.environ.get(SWITCHES[name]) == "1"
