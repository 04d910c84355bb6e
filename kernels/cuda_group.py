"""Linears that read the same x as one call on our CUDA kernels (``CudaLinear.grouped``): q, k and
v of an attention layer, gate and up of a dense MLP. One gemv (or gemv_pro) launch and one output
pass for all, where each alone takes three launches of its own (kernels/cuda_exl3.py)."""

from __future__ import annotations

import math

import torch
from exl3tools.kernels.cuda_exl3 import SMALL_ROWS, CudaLinear
from exl3tools.kernels.cuda_gemv import _act, gemv, gemv_pro, gemv_pro_fits, had_in, had_out
from exl3tools.kernels.cuda_workspace import workspace


class CudaGroup:
    """Linears that read the same x (q, k and v; a dense MLP's gate and up) as one call: one gemv
    (or gemv_pro) launch and one output pass for all, where each alone takes its own.

    Each linear is cut into column chunks of one width c (the gcd of their widths, whole 128-column
    Hadamard blocks); chunk z is slot z of a grouped call, its trellis addressed by pointer into the
    linear's own (no copy) with that trellis's width as row stride (``ld_tab``), its sign vector,
    svh and bias by pointer too. ``__call__(x)`` -> one (rows, n_i) tensor per linear: with one row,
    views of the call's (slots x rows, c) output; with more, the slots of a linear of several chunks
    come out slot-major and are copied into place (one copy each).
    """

    def __init__(self, linears: list[CudaLinear], c: int):
        first = linears[0]
        self.linears, self.c, self.k, self.kt = linears, c, first.k, first.kt
        self.device, self.mod = first.device, first.mod
        self.cnt = c // 16                               # n-tiles a chunk
        tile_bytes = first.width * 2                     # int16 a tile
        tr, ld, suh, svh, bias, self.spans = [], [], [], [], [], []
        zero = None
        for lin in linears:
            nc = lin.n // c
            self.spans.append((len(tr), len(tr) + nc))
            for j in range(nc):
                tr.append(lin.trellis.data_ptr() + j * self.cnt * tile_bytes)
                ld.append(lin.nt)
                suh.append(lin.suh.data_ptr())
                svh.append(lin.svh.data_ptr() + j * c * 2)
                if any(m.bias is not None for m in linears):
                    if lin.bias is None and zero is None:
                        zero = torch.zeros(c, dtype=torch.float16, device=self.device)
                    bias.append(zero.data_ptr() if lin.bias is None else lin.bias.data_ptr() + j * c * 2)
        self._zero = zero                                # held: bias_tab may point at it
        self.slots = len(tr)

        def tab(v, dtype=torch.int64):
            return torch.tensor(v, dtype=dtype, device=self.device)
        self.tr_tab, self.suh_tab, self.svh_tab = tab(tr), tab(suh), tab(svh)
        self.bias_tab = tab(bias) if bias else None
        self.ld_tab = tab(ld, torch.int32)
        self.slot_exp = torch.arange(self.slots, dtype=torch.int32, device=self.device)
        self.gemv_in = first.gemv_in
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def plan(linears: list) -> int | None:
        """The chunk width for ``linears`` (the gcd of their widths: whole 128-column blocks, since
        every width is), or None where they cannot be one call: not all CudaLinear, other inputs,
        trellis widths, codebooks or devices, batch-invariant runs (their fixed K splits)."""
        if len(linears) < 2 or not all(type(m) is CudaLinear for m in linears):
            return None
        a = linears[0]
        if any(m.invariant or m.k != a.k or m.width != a.width or m.codebook != a.codebook or m.device != a.device
               for m in linears):
            return None
        return math.gcd(*(m.n for m in linears))

    def _index(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row_src, row_exp) int32 of rows slots x ``rows``: row o = z * rows + m reads x[m] with
        slot z's sign vector; made once per row count (outside graph capture: the warm-up's)."""
        got = self._rows.get(rows)
        if got is None:
            src = torch.arange(rows, dtype=torch.int32, device=self.device).repeat(self.slots)
            exp = self.slot_exp.repeat_interleave(rows)
            got = (src, exp)
            if not torch.cuda.is_current_stream_capturing():
                self._rows[rows] = got
        return got

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        x2 = _act(x, self.k)
        rows = x2.shape[0]
        if rows == 0 or rows > SMALL_ROWS:
            return [lin(x) for lin in self.linears]
        src, exp = self._index(rows)
        N = self.slots * rows
        acc = workspace(self.device, N * self.c)
        if self.gemv_in and gemv_pro_fits(rows, x2.dtype):
            gemv_pro(self.mod, x2, self.suh_tab, self.tr_tab, self.kt, self.cnt, rows, self.slots, acc,
                     slot_exp=self.slot_exp, row_src=src, row_exp=exp, ld_tab=self.ld_tab)
        else:
            xrot = had_in(self.mod, x2, self.suh_tab, 1, N, self.k, src=src, exp=exp)
            gemv(self.mod, xrot, self.tr_tab, self.kt, self.cnt, rows, self.slots, acc, slot_exp=self.slot_exp,
                 ld_tab=self.ld_tab)
            del xrot
        y = torch.empty(N, self.c, dtype=x2.dtype, device=self.device)
        had_out(self.mod, acc, y, self.svh_tab, self.bias_tab, 1, N, self.c, exp=exp)
        y3 = y.view(self.slots, rows, self.c)
        out = []
        for a, b in self.spans:
            part = y3[a:b]
            part = part.reshape(rows, -1) if rows == 1 or b - a == 1 else part.transpose(0, 1).reshape(rows, -1)
            out.append(part.to(x.dtype).reshape(*x.shape[:-1], -1))
        return out
