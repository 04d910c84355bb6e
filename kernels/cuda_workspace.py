"""The device buffers our CUDA kernels add into (backend ``cuda``): the fp32 split-K workspace that
the gemv launches of kernels/cuda_gemv.py share (self-cleaning: the output pass re-zeroes what it
reads), its int64 view for batch-invariant runs (``fixed_workspace``), and the split counts and
scratch of the wgr kernels with the output pass fused (``wgr_buffers``). Each is kept per device
index (a workspace request past WORKSPACE_KEEP gets one of its own) and grown only outside CUDA-graph
capture; an outgrown one is kept, never freed, because a graph captured earlier replays into it."""

from __future__ import annotations

import torch

_workspace: dict[int, torch.Tensor] = {}
_retired: list[torch.Tensor] = []      # outgrown workspaces: captured graphs may still point at them


WORKSPACE_KEEP = 1 << 24     # floats (64 MiB): larger requests outside graph capture get a buffer of their own


def _kept(kept: dict[int, torch.Tensor], device: torch.device, numel: int, dtype: torch.dtype, least: int,
          zero: bool) -> torch.Tensor | None:
    """``kept``'s buffer for ``device`` if it holds ≥ numel, else a new one of max(numel, least)
    (zeroed where ``zero``) in its place, the outgrown one kept, never freed, because a CUDA graph
    captured earlier replays into it; None where it would have to grow under graph capture."""
    buf = kept.get(device.index)
    if buf is None or buf.numel() < numel:
        if torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _retired.append(buf)
        buf = kept[device.index] = (torch.zeros if zero else torch.empty)(max(numel, least), dtype=dtype,
                                                                            device=device)
    return buf


def workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A zero fp32 buffer of ≥ numel shared by all small-row calls on ``device``.

    Every gemv adds into it and the output pass that follows re-zeroes what it read, so it is
    zero between calls (stream order; one stream per device). Grown only outside graph capture
    (``_kept``). A request above WORKSPACE_KEEP floats (a long prefill's MoE tiles) gets a fresh
    zeroed buffer, freed after the call: the shared one, and what it retires, stay small. Under
    capture (a prompt-step graph of hundreds of rows) that buffer comes from the graph's pool and
    its zeroing is part of the graph, since its warm-up never grew the shared one.
    """
    if numel > WORKSPACE_KEEP:
        return torch.zeros(numel, dtype=torch.float32, device=device)
    ws = _kept(_workspace, device, numel, torch.float32, 1 << 22, zero=True)
    if ws is None:
        raise RuntimeError("cuda backend: workspace must grow during CUDA-graph capture; warm up first")
    return ws


_wgr_flags: dict[int, torch.Tensor] = {}
_wgr_scratch: dict[int, torch.Tensor] = {}


def wgr_buffers(device: torch.device, tiles: int, splits: int, rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(flags, scratch) of a wgr launch with the output pass that splits K: an int32 count a tile
    (zero between launches: the last split to arrive re-zeroes it) and ``splits`` partial sums of
    ``rows`` (the kernel's slot) x 128 fp32 a tile. Each kept per device (``_kept``, as
    ``workspace``); under capture one too small is replaced by the graph's own (from its pool, the
    counts' zeroing part of the graph)."""
    need = tiles * splits * rows * 128
    flags = _kept(_wgr_flags, device, tiles, torch.int32, 1024, zero=True)
    scratch = _kept(_wgr_scratch, device, need, torch.float32, 1 << 22, zero=False)
    return (torch.zeros(tiles, dtype=torch.int32, device=device) if flags is None else flags,
            torch.empty(need, dtype=torch.float32, device=device) if scratch is None else scratch)


def fixed_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """``workspace`` as ``numel`` int64 (the fixed-point sums of batch-invariant gemv calls; zero
    bits are zero either way, and had_out_i64 re-zeroes what it reads)."""
    return workspace(device, 2 * numel)[:2 * numel].view(torch.int64)
