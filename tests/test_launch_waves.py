"""K splits by launch_waves.wave_splits (pure Python: the wgr route's choice, checked on the CPU)."""

from __future__ import annotations

import pytest
from exl3tools.kernels.launch_waves import wave_splits

H100 = 132 * 4          # resident units: 132 SMs, one wgr block (4 units) each


@pytest.mark.parametrize("tiles,most,splits", [
    (64, 64, 2),      # 8192 -> 8192 at 256 rows: two splits fill one wave, as the one-wave rule
    (32, 112, 4),     # 14336 -> 4096 at 256 rows: four
    (8, 32, 16),      # 4096 -> 1024 at 256 rows: the one-wave rule's 16, past WAVE_MOST_SPLITS
    (112, 32, 1),     # 4096 -> 14336 at 256 rows: 112 of 132 SMs in one wave beats every split
    (96, 32, 1),      # 4096 -> 12288 at 256 rows: four splits model within WAVE_MIN_GAIN
    (86, 32, 3),      # 4096 -> 11008 at 256 rows: 86 SMs busy, 46 idle; thirds in two waves
    (192, 32, 2),     # 4096 -> 12288 at 512 rows: two waves (the second 45 % full) -> three of halves
    (224, 32, 1),     # 4096 -> 14336 at 512 rows: the second wave 70 % full
    (2, 8, 8),        # capped by ``most`` (a split is at least 8 k-tiles)
    (200, 1, 1),      # too short a k-range to split
])
def test_wave_splits(tiles, most, splits):
    assert wave_splits(tiles * 4, H100, most) == splits
