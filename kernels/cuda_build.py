"""Build the CUDA kernels: backend ``cuda``'s, one cubin per (K2, codebook), and the MLA decode
kernel's (kernels/mla_cuda.py), cached on disk.

kernels/csrc/exl3_gemv.cu (with the csrc/*.cuh it includes) is compiled by nvcc with -DK2/-DCB for
sm_90a (Hopper); csrc/mla_decode.cu once. Cubins are cached under ``EXL3TOOLS_CUDA_CACHE`` (default ~/.cache/exl3tools/cuda),
named by a hash of the sources and flags, so a folder of prebuilt cubins makes nvcc unnecessary at run time. No torch here:

    python -m exl3tools.kernels.cuda_build        # prebuild every (K, codebook) in parallel
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from exl3tools.errors import UsageError

SRC = Path(__file__).with_name("csrc") / "exl3_gemv.cu"
MLA_SRC = SRC.with_name("mla_decode.cu")
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


def can_build_mla() -> bool:
    """nvcc is here, or the MLA kernel's cubin is already cached."""
    return _nvcc() is not None or mla_cubin_path().exists()


def sources(src: Path | None = None) -> bytes:
    """``src`` (SRC) and the headers beside it (csrc/*.cuh), in a fixed order: the cubins' cache
    key, so an edit to any of them builds anew."""
    src = src or SRC
    return b"".join(p.read_bytes() for p in [src, *sorted(src.parent.glob("*.cuh"))])


def _cached(stem: str, src: Path, defines: tuple[str, ...]) -> Path:
    key = hashlib.sha1(sources(src) + repr((FLAGS, *defines)).encode()).hexdigest()[:16]
    return cache_dir() / f"{stem}_{key}.cubin"


def halves(cb: int) -> bool:
    """The halves build (exl3_gemv.cu HALVES) for codebook id ``cb``: 3INST and MCG unless
    EXL3TOOLS_GEMV_HALVES=0, MUL1 (its AFF kernels) unless EXL3TOOLS_GEMV_AFFINE=0 (runtime/preview.py
    OPT_OUTS gemv_halves, gemv_affine); never in batch-invariant runs (the 8-row kernels'
    arithmetic would then differ from the wider ones', so a row's result from the batch it is in).
    A build define: a process reads it when it first builds or loads a module."""
    from exl3tools.runtime import invariance, preview  # torch-free

    if invariance.on():
        return False
    return preview.switched_on("gemv_affine" if cb == CODEBOOKS["mul1"] else "gemv_halves")


def extra_defines() -> tuple[str, ...]:
    """EXL3TOOLS_GEMV_DEFINES: extra -D flags for exl3_gemv.cu (a tuning A/B of its build constants,
    PRO_P, PRO_MINB, XDUP_SMEM: bench/gpu_all.sh's defs stage), part of the cubins' cache key;
    integers decimal or hex; separated by spaces or commas (a value without spaces fits
    gpu_all.sh's TEST_ENVS, "VAR=value ...")."""
    flags = tuple(os.environ.get("EXL3TOOLS_GEMV_DEFINES", "").replace(",", " ").split())
    for f in flags:
        if not re.fullmatch(r"-D[A-Z_][A-Z0-9_]*(=-?(0x[0-9A-Fa-f]+|[0-9]+))?", f):
            raise UsageError(f"EXL3TOOLS_GEMV_DEFINES: {f!r} is not -DNAME or -DNAME=integer")
    return flags


def extra_define(name: str) -> int:
    """The value EXL3TOOLS_GEMV_DEFINES gives ``name`` as nvcc reads it: -DNAME is 1, absent 0."""
    value = 0
    for f in extra_defines():
        key, _, v = f[2:].partition("=")
        if key == name:
            value = int(v, 0) if v else 1
    return value


def cubin_path(k2: int, cb: int) -> Path:
    # the plain build's cache key stays (k2, cb), so earlier prebuilt folders still serve MUL1 and
    # the opt-out
    return _cached(f"exl3_gemv_k{k2}_c{cb}", SRC, ((k2, cb, "halves") if halves(cb) else (k2, cb)) + extra_defines())


def mla_cubin_path() -> Path:
    return _cached("mla_decode", MLA_SRC, ())


def build(k2: int, cb: int) -> Path:
    """The cubin for (K2, codebook id), compiled now if it is not cached yet."""
    return _compile(cubin_path(k2, cb), SRC, (f"-DK2={k2}", f"-DCB={cb}", *(("-DHALVES=1",) if halves(cb) else ()),
                                              *extra_defines()))


def build_mla() -> Path:
    """The MLA decode kernel's cubin (kernels/mla_cuda.py), compiled now if it is not cached yet."""
    return _compile(mla_cubin_path(), MLA_SRC, ())


def _compile(out: Path, src: Path, defines: tuple[str, ...]) -> Path:
    if out.exists():
        return out
    nvcc = _nvcc()
    if nvcc is None:
        raise UsageError(f"the CUDA kernels need nvcc to build {out.name} (set EXL3TOOLS_NVCC, or "
                         f"EXL3TOOLS_CUDA_CACHE to a folder of prebuilt cubins)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # one compile of a cubin at a time (test workers, TP ranks): the others wait for it, then
    # find it built (an flock: released when its holder exits, however it exits)
    with open(out.with_name(out.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        return _nvcc_to(out, nvcc, src, defines)


def _nvcc_to(out: Path, nvcc: str, src: Path, defines: tuple[str, ...]) -> Path:
    tmp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [nvcc, *FLAGS, *defines, str(src), "-o", str(tmp)]
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
    paths = [*prebuild(), build_mla()]
    print(f"{len(paths)} cubins in {cache_dir()}", file=sys.stderr)
    if "--names" in sys.argv[1:]:     # the default set's file names (bench/gpu_all.sh packs those alone)
        print("\n".join(p.name for p in paths))
