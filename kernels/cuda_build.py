"""Build the CUDA kernels of backend ``cuda``: one cubin per (K2, codebook), cached on disk.

kernels/csrc/exl3_gemv.cu (with the csrc/*.cuh it includes) is compiled by nvcc with -DK2/-DCB for
sm_90a (Hopper). Cubins are cached under ``EXL3TOOLS_CUDA_CACHE`` (default ~/.cache/exl3tools/cuda),
named by a hash of the sources and flags, so a folder of prebuilt cubins makes nvcc unnecessary at run time. No torch here:

    python -m exl3tools.kernels.cuda_build        # prebuild every (K, codebook) in parallel
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from exl3tools.errors import UsageError

SRC = Path(__file__).with_name("csrc") / "exl3_gemv.cu"
CODEBOOKS = {"3inst": 0, "mcg": 1, "mul1": 2}
ARCH = "-gencode=arch=compute_90a,code=sm_90a"
FLAGS = ("-std=c++17", "-O3", "-cubin", ARCH)
WIDTHS = (16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)     # K = 1, 1.5, 2, ... 8


def cache_dir() -> Path:
    d = os.environ.get("EXL3TOOLS_CUDA_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "exl3tools" / "cuda"


def _nvcc() -> str | None:
    for cand in (os.environ.get("EXL3TOOLS_NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def can_build() -> bool:
    """nvcc is here, or the cache holds prebuilt cubins."""
    return _nvcc() is not None or any(cache_dir().glob("exl3_gemv_*.cubin"))


def sources() -> bytes:
    """SRC and the headers beside it that it includes (csrc/*.cuh), in a fixed order: the cubins'
    cache key, so an edit to any of them builds anew."""
    return b"".join(p.read_bytes() for p in [SRC, *sorted(SRC.parent.glob("*.cuh"))])


def cubin_path(k2: int, cb: int) -> Path:
    key = hashlib.sha1(sources() + repr((FLAGS, k2, cb)).encode()).hexdigest()[:16]
    return cache_dir() / f"exl3_gemv_k{k2}_c{cb}_{key}.cubin"


def build(k2: int, cb: int) -> Path:
    """The cubin for (K2, codebook id), compiled now if it is not cached yet."""
    out = cubin_path(k2, cb)
    if out.exists():
        return out
    nvcc = _nvcc()
    if nvcc is None:
        raise UsageError(f"backend 'cuda' needs nvcc to build {out.name} (set EXL3TOOLS_NVCC, or "
                         f"EXL3TOOLS_CUDA_CACHE to a folder of prebuilt cubins)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [nvcc, *FLAGS, f"-DK2={k2}", f"-DCB={cb}", str(SRC), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed for {out.name}:\n{res.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


def all_pairs() -> list[tuple[int, int]]:
    """Every (K2, codebook id) a checkpoint can hold (half-integer K is MUL1-only in exllamav3)."""
    return [(w // 8, cb) for w in WIDTHS for name, cb in CODEBOOKS.items() if w % 16 == 0 or name == "mul1"]


def prebuild(pairs=None, jobs: int | None = None) -> list[Path]:
    """Compile several (K2, codebook id) modules in parallel (nvcc is single-threaded)."""
    pairs = list(dict.fromkeys(all_pairs() if pairs is None else pairs))
    with ThreadPoolExecutor(jobs or min(16, os.cpu_count() or 4)) as pool:
        return list(pool.map(lambda p: build(*p), pairs))


if __name__ == "__main__":
    paths = prebuild()
    print(f"{len(paths)} cubins in {cache_dir()}", file=sys.stderr)
