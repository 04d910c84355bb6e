"""How many K splits a GEMM launch takes so that its units fill whole waves of the SMs (pure
Python: the CUDA launchers in cuda_exl3 call it; CPU tests check the choices).

A launch of wgr kernels that add their K splits inside (cuda_exl3 WGR_RG_OUT_KERNELS) can split at
any count where no split waits for the others (the -DWGR_FIX_LAST=1 build: the last split to arrive
finishes the tile; ``cuda_build.wgr_waits``), so a launch whose last wave is part-empty can split K to
fill the waves instead of leaving SMs idle: 4096 -> 12288 at 512 rows is 192 tiles on 132 SMs, two
waves of whole tiles (the second 45 % full) or three waves of half tiles. (The default build's
fixup has every split wait for all the others: past one wave that can hang, so there the one-wave
rule stays.)
"""

from __future__ import annotations

# wave_splits' model of a launch: each unit costs its share of the k-range plus WAVE_UNIT_COST of a
# whole-K tile (the stages' fill, the epilogue's output pass), a launch of several splits
# WAVE_SPLIT_COST more (the fixup's stores and reloads: 3-4 µs of ~75 at 8192 -> 8192, 256 rows)
WAVE_UNIT_COST = 0.1
WAVE_SPLIT_COST = 0.05
WAVE_MOST_SPLITS = 8
WAVE_MIN_GAIN = 0.03      # more splits only where the model saves this much of the fewer's time


def wave_splits(need: int, resident: int, most: int) -> int:
    """K splits (at most ``most``) for a launch of ``need`` units a split on ``resident`` resident
    units, by the modelled time waves x (1 / splits + WAVE_UNIT_COST) (+ WAVE_SPLIT_COST past one
    split): a launch whose last wave is part-empty splits K so that its units fill the waves (4096 ->
    12288 at 512 rows: 192 tiles on 132 SMs take two waves whole, three of halves); one wave's split
    (resident // need) stays a candidate; a count wins over fewer only by WAVE_MIN_GAIN."""
    def cost(s: int) -> float:
        return -(-need * s // resident) * (1 / s + WAVE_UNIT_COST) + (WAVE_SPLIT_COST if s > 1 else 0.0)
    best = 1
    for s in range(2, min(most, max(WAVE_MOST_SPLITS, resident // need)) + 1):
        if cost(s) < cost(best) * (1 - WAVE_MIN_GAIN):
            best = s
    return best
