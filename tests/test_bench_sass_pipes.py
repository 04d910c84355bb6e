"""bench/sass_pipes.py reads the k-tile loop out of a kernel's SASS (no nvcc needed for this)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sass_pipes.py"


def _module():
    spec = importlib.util.spec_from_file_location("sass_pipes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sass(texts: list[str]) -> str:
    """cuobjdump-style lines, 16 bytes apart from 0x100; "BRA @k" branches to instruction k."""
    addr = [0x100 + 16 * k for k in range(len(texts))]
    out = []
    for a, t in zip(addr, texts, strict=True):
        if "BRA @" in t:
            head, k = t.split("@")[0:-1], int(t.rsplit("@", 1)[1])
            t = "@".join(head) + f"0x{addr[k]:x}"
        out.append(f"        /*{a:04x}*/                   {t} ;   /* 0x0000 */")
    return "\n".join(out)


def test_the_loop_is_the_largest_backward_branch_body_of_150_to_800_instructions():
    """A 200-instruction loop nested in a 900-instruction one (the PRO prologue's shape) beside a
    20-instruction one: the 200 are counted, predicates and modifiers stripped."""
    body = ["@!P0 SHF.R.U32.HI R3, RZ, 0x3, R4" if i % 2 else "LOP3.LUT R5, R6, R7, RZ, 0xc0, !PT" for i in range(199)]
    texts = (["IMAD.MOV.U32 R1, RZ, RZ, R2"] * 300 + body + ["@!P1 BRA @300"]
             + ["IDP.4A.U8.U8 R8, R9, R10, R11"] * 400 + ["@P2 BRA @0"]
             + ["HMMA.16816.F32 R12, R14, R16, R12"] * 19 + ["BRA @901"])
    ops = _module().kernel_loop(_sass(texts))
    assert len(ops) == 200
    assert ops.count("SHF") == 99 and ops.count("LOP3") == 100 and ops[-1] == "BRA"
