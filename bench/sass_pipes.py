"""The 1-row gemv loop's SASS by pipe for build define sets, side by side (CPU only: nvcc and
cuobjdump, no GPU; `bash bench/get_sass_tools.sh` fetches cuobjdump where the toolkit lacks it).

ncu found the 1-row kernel's ALU pipe (half rate: a warp instruction every other cycle) the
busiest and throttling, the FMA pipe two thirds idle (docs/gpu-sessions.md, 2026-12-05 10:51). This counts,
for each EXL3TOOLS_GEMV_DEFINES-style set, the kernel's innermost large loop (the k-tile loop)
by opcode, the ALU and FMA pipes' shares, and "ALU cycles" (2 an ALU instruction) beside FMA
cycles (1 each), registers and spills, so a timed A/B (bench/gpu_all.sh defs) can be read
against what each set changed. The counts are a guide, not a timing: moving the window
extraction onto the FMA pipe (IMAD, IMAD.HI) cut the ALU cycles 28 % and made MUL1 13 % slower,
IMAD.HI taking two FMA-pipe cycles (docs/gpu-sessions.md, the 2026-12-05 21:12 session):

    python bench/sass_pipes.py --k2 6 --cb 0,2 --defs ";-DXDUP_SMEM=1;-DXDUP_SMEM=1 -DPRO_MINB=6"
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exl3tools.kernels import cuda_build  # noqa: E402  (torch-free)

ALU = ("SHF", "LOP3", "PRMT", "ISETP", "IADD3", "LEA", "SEL", "VIADD", "MOV", "IABS", "FSEL")
FMA = ("IMAD", "IDP", "FFMA", "FMUL", "FADD")
FP16 = ("HFMA2", "HMUL2", "HADD2")


def cuobjdump() -> str:
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                 str(Path(__file__).resolve().parents[1] / ".sass-tools" / "bin" / "cuobjdump")):
        if cand and Path(cand).exists():
            return cand
    sys.exit("sass_pipes: no cuobjdump (bash bench/get_sass_tools.sh, or set CUOBJDUMP)")


def kernel_loop(sass: str) -> list[str]:
    """Opcodes of the k-tile loop: the largest loop of 150-800 instructions (a backward branch's
    body; the PRO prologue's loop around it is larger, the Hadamard loops smaller)."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    best: list[str] = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if 150 <= len(body) <= 800 and len(body) > len(best):
                best = body
    return [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best]


def measure(k2: int, cb: int, defines: str, fun: str, tmp: Path) -> dict:
    out = tmp / "g.cubin"
    res = subprocess.run(["nvcc", *cuda_build.FLAGS, "-Xptxas", "-v", f"-DK2={k2}", f"-DCB={cb}", "-DHALVES=1",
                          *defines.split(), str(cuda_build.SRC), "-o", str(out)], capture_output=True, text=True)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1][:120]}
    m = re.search(rf"Compiling entry function '{fun}'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                  res.stderr, re.S)
    sass = subprocess.run([cuobjdump(), "-sass", "-fun", fun, str(out)], capture_output=True, text=True).stdout
    ops = Counter(kernel_loop(sass))
    alu, fma, f16 = (sum(ops[o] for o in group) for group in (ALU, FMA, FP16))
    return {"spill": int(m.group(1)) if m else -1, "regs": int(m.group(2)) if m else -1, "loop": sum(ops.values()),
            "alu": alu, "fma": fma, "fp16": f16, "top": ", ".join(f"{o} {n}" for o, n in ops.most_common(6))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k2", type=int, default=6, help="trellis width / 8 (6: K 3)")
    ap.add_argument("--cb", default="0,1,2", help="codebook ids: 0 3INST, 1 MCG, 2 MUL1 (AFF)")
    ap.add_argument("--defs", default=";-DXDUP_SMEM=1", help="define sets, ';'-separated (empty: the default)")
    a = ap.parse_args()
    print(f"{'cb':>3} {'defines':<44} {'regs':>4} {'spill':>5} {'loop':>4} {'ALU':>4} {'FMA':>4} {'fp16':>4}"
          f" {'ALU cyc / FMA cyc':>17}  top opcodes")
    with tempfile.TemporaryDirectory() as d:
        for cb in (int(c) for c in a.cb.split(",")):
            fun = "exl3_gemv_pro_aff_m8_t2_f16" if cb == 2 else "exl3_gemv_pro_m8_t2_f16"
            for defs in a.defs.split(";"):
                r = measure(a.k2, cb, defs, fun, Path(d))
                if "error" in r:
                    print(f"{cb:>3} {defs or 'default':<44} nvcc failed: {r['error']}")
                    continue
                cyc = f"{2 * r['alu']} / {r['fma']}"
                print(f"{cb:>3} {defs or 'default':<44} {r['regs']:>4} {r['spill']:>5} {r['loop']:>4} {r['alu']:>4}"
                      f" {r['fma']:>4} {r['fp16']:>4} {cyc:>17}  {r['top']}")


if __name__ == "__main__":
    main()
