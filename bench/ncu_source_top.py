"""The SASS instructions where a kernel's warps stall most, from an ncu source-page export:

    ncu --set full --import-source yes -o rep python3 bench/ncu_mla.py ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 bench/ncu_source_top.py src.csv [N]

Prints the N (default 40) instructions with the most "Warp Stall Sampling (All Samples)", their
share of all samples, and the running share, in address order within the top set too (so a
loop's hot spots read in program order)."""

from __future__ import annotations

import csv
import sys


def main() -> int:
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as fh:
        lines = fh.read().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"')), None)   # past the banner
    rows = list(csv.DictReader(lines[start:])) if start is not None else []
    if not rows:
        print("no rows")
        return 1
    col = next(c for c in rows[0] if "Sampling" in c and "All" in c)
    src = next((c for c in rows[0] if c.strip().lower() == "source"), None)
    addr = next((c for c in rows[0] if "Address" in c), None)

    def samples(r):
        try:
            return float(r[col] or 0)
        except ValueError:
            return 0.0
    total = sum(samples(r) for r in rows) or 1.0
    top = sorted(rows, key=samples, reverse=True)[:n]
    print(f"{len(rows)} instructions, {total:.0f} samples ({col}); top {n}: {sum(map(samples, top)) / total:.0%}")
    order = {id(r): i for i, r in enumerate(rows)}
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]

    def why(r):   # the two largest stall reasons of an instruction
        got = sorted(((float(r[c] or 0), c[6:]) for c in reasons), reverse=True)[:2]
        return " ".join(f"{name} {v / (samples(r) or 1):.0%}" for v, name in got if v)
    for r in sorted(top, key=lambda r: order[id(r)]):
        print(f"{r.get(addr, '?'):>8} {samples(r) / total:6.1%}  {(r.get(src) or '').strip()[:80]:80}  {why(r)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
