"""Batch-invariant serving (``serve --batch-invariant``, ``EXL3TOOLS_BATCH_INVARIANT=1``).

By default a request's logits depend, at float rounding, on what else is in its step: the EXL3
kernels split K by how many rows and slots a launch has and add the splits' fp32 partials with
atomics in arrival order; MoE switches to expert-sorted tiles from 128 pairs; the paged
attention splits the context by the batch size; cuBLAS picks a GEMM by the row count; a long
prompt takes the eager forward. Near-flat logits can then flip a sampled token, so one seed gives
one text alone and another among 32 streams. In this mode every row of a step is computed exactly
as it would be alone, on CUDA, for GQA models at TP 1:

- EXL3 linears and experts: splits fixed by the weight's shape, partial sums added as fixed-point
  int64 (order-free); more than 64 rows in 64-row slots of the shared-memory tile kernel, whose
  per-row arithmetic is the gemv kernel's (kernels/cuda_gemv.py); the MoE's expert-sorted tiles with
  their rows put back in pair order (runtime/fused_step.py);
- paged decode attention: a fixed number of key tiles per split for every row
  (kernels/paged_attention.invariant_splits);
- small dense GEMMs (the router, unquantized linears): ``rows_mm``, fixed-shape chunks;
- every step, prompts included, runs the fixed-shape step (decode and prompt buckets); the prompt
  budget is capped so that no step needs the eager forward (``cap_prefill_tokens``).

Cost (docs/serve.md): prompts run through the decode kernels, experts without tiles. A by-product:
a prefix-cache hit computes exactly what a cold run does.
"""

from __future__ import annotations

import os

VARIABLE = "EXL3TOOLS_BATCH_INVARIANT"
CHUNK = 64            # rows_mm's fixed GEMM height
PROMPT_ROWS = 256     # the largest step (prompt bucket) in this mode


def on() -> bool:
    return os.environ.get(VARIABLE) == "1"


def cap_prefill_tokens(max_prefill_tokens: int, max_num_seqs: int) -> int:
    """The prompt-token budget of a step such that decode rows plus prompt rows fit PROMPT_ROWS."""
    return max(1, min(int(max_prefill_tokens), PROMPT_ROWS - int(max_num_seqs)))


def prefill_tokens(max_prefill_tokens: int, max_num_seqs: int) -> int:
    """A server's prompt-token budget a step: capped in this mode (``cap_prefill_tokens``), as given
    otherwise. The engine and the runner both take it (server/app.py), so their steps agree."""
    return cap_prefill_tokens(max_prefill_tokens, max_num_seqs) if on() else int(max_prefill_tokens)


def rows_mm(x, w, bias=None):
    """``x @ w (+ bias)`` for (rows, k) x, each row through the same (CHUNK, k) x (k, n) GEMM
    whatever the rows: a GEMM library picks its kernel (and so its summation order) by shape, and a
    fixed shape gives every row one order. The padding rows are zeros."""
    import torch
    import torch.nn.functional as F

    rows = x.shape[0]
    if rows == 0:
        y = x.new_empty(0, w.shape[1])
    else:
        pad = -rows % CHUNK
        xp = F.pad(x, (0, 0, 0, pad)) if pad else x
        y = torch.cat([xp[r:r + CHUNK] @ w for r in range(0, rows + pad, CHUNK)])[:rows]
    return y if bias is None else y + bias
