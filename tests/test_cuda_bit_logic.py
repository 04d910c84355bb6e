"""The CUDA kernels' bit logic on the host: every lane's 8 trellis windows, every trellis width.

kernels/csrc/exl3_gemv.cu compiled with -DEXL3_HOST_TEST checks its own lane_origin/lane_states
(the part of the kernel that turns tile words into states) against the ring-bit definition of
exl3-format.md §5.3 on random tiles. Needs nvcc only (no GPU); skipped without it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "exl3_gemv.cu"


def _cuda_include() -> Path | None:
    """The toolkit's headers (cuda_fp16.h), for compiling the host check with the host compiler."""
    nvcc = shutil.which("nvcc")
    for root in (os.environ.get("CUDA_HOME"), nvcc and Path(nvcc).resolve().parents[1], "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            return Path(root) / "include"
    return None


def _compile(k2: int, exe: Path) -> None:
    """g++ on the host-only code (what nvcc's host pass runs, in ~0.4 s instead of 2.5-7 s: the
    device passes of nvcc dominate, and 15 widths ran ~100 s of a loaded CI machine); nvcc where
    no g++ or headers are found."""
    inc = _cuda_include()
    if shutil.which("g++") and inc is not None:
        cmd = ["g++", "-std=c++17", "-O1", "-DEXL3_HOST_TEST", f"-DK2={k2}", "-x", "c++", f"-I{inc}",
               "-include", "cuda_runtime.h", str(SRC), "-o", str(exe)]
    else:
        cmd = ["nvcc", "-std=c++17", "-DEXL3_HOST_TEST", f"-DK2={k2}", "-x", "cu", str(SRC),
               "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (host-side check, no GPU)")
@pytest.mark.parametrize("k2", range(2, 17))
def test_host_bit_logic(tmp_path, k2):
    exe = tmp_path / "bits"
    _compile(k2, exe)
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    assert f"K2={k2} " in res.stdout, res.stdout
    assert res.stdout.rstrip().endswith("ok"), res.stdout


def test_cubin_key_covers_the_included_headers(tmp_path, monkeypatch):
    """The cubins' cache key hashes exl3_gemv.cu and every csrc/*.cuh it includes: an edit to a
    header (exl3_tiles.cuh) names a new cubin instead of loading a stale one."""
    from exl3tools.kernels import cuda_build

    src = tmp_path / "exl3_gemv.cu"
    src.write_text('#include "exl3_tiles.cuh"\n')
    (tmp_path / "exl3_tiles.cuh").write_text("// v1\n")
    monkeypatch.setattr(cuda_build, "SRC", src)
    first = cuda_build.cubin_path(6, 2).name
    (tmp_path / "exl3_tiles.cuh").write_text("// v2\n")
    assert cuda_build.cubin_path(6, 2).name != first
    # the real tree: the headers the key hashes are exactly those exl3_gemv.cu includes
    assert {p.name for p in SRC.parent.glob("*.cuh")} == set(re.findall(r'#include "(\w+\.cuh)"', SRC.read_text()))
    assert {"exl3_tiles.cuh", "exl3_wgmma.cuh"} <= {p.name for p in SRC.parent.glob("*.cuh")}


def test_processes_building_one_cubin_compile_it_once(tmp_path):
    """Three processes asking for the same missing cubin at once (test workers, TP ranks): one
    runs nvcc, the others wait for it and load its file (a slow fake nvcc that counts its runs)."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text('#!/bin/sh\necho run >> "$(dirname "$0")/runs"\nsleep 1\n'
                    'while [ $# -gt 1 ]; do [ "$1" = -o ] && echo cubin > "$2"; shift; done\n')
    nvcc.chmod(0o755)
    env = {**os.environ, "EXL3TOOLS_NVCC": str(nvcc), "EXL3TOOLS_CUDA_CACHE": str(tmp_path / "cache")}
    env.pop("EXL3TOOLS_GEMV_DEFINES", None)
    code = "from exl3tools.kernels import cuda_build as c; print(c.build(6, 2).read_text().strip())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0] and outs == ["cubin"] * 3, outs
    assert (tmp_path / "runs").read_text().split() == ["run"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles for sm_90a, no GPU)")
def test_the_mla_kernel_builds_for_hopper_without_spills(tmp_path):
    """kernels/csrc/mla_decode.cu through cuda_build's flags: ptxas allocates its 128 output
    accumulators, the scores and the probabilities in registers (a spill would put local-memory
    traffic inside the key loop) under the one-block-an-SM launch bound."""
    from exl3tools.kernels import cuda_build

    res = subprocess.run(["nvcc", *cuda_build.FLAGS, "-Xptxas", "-v", str(cuda_build.MLA_SRC),
                          "-o", str(tmp_path / "mla.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    kernels = {"mla_decode_tma"} | {f"mla_decode_pp{ps}{pad}" for ps in ("", "_ps") for pad in ("", "_pad")}
    assert set(re.findall(r"Compiling entry function '(\w+)'", res.stderr)) == kernels
    props = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    assert len(props) == len(kernels) and all(p == ("0", "0") for p in props), res.stderr[-2000:]
    # ptxas serialises the warpgroup MMAs where it cannot prove their accumulators untouched (a
    # branch between two MMAs of one chain): each MMA would wait for the one before
    assert "C7520" not in res.stderr, res.stderr[-2000:]


def test_the_halves_build_names_its_own_cubins(monkeypatch):
    """The default builds every codebook with -DHALVES=1 (3INST and MCG: the halves gemv, MUL1: its
    AFF kernels) under their own cache names; the opt-outs' (EXL3TOOLS_GEMV_HALVES=0,
    EXL3TOOLS_GEMV_AFFINE=0) names are the plain build's, so earlier prebuilt cubin folders keep
    serving them; batch-invariant runs keep the plain build."""
    from exl3tools.kernels import cuda_build

    monkeypatch.setenv("EXL3TOOLS_GEMV_HALVES", "0")
    monkeypatch.setenv("EXL3TOOLS_GEMV_AFFINE", "0")
    off = {cb: cuda_build.cubin_path(6, cb).name for cb in (0, 1, 2)}
    monkeypatch.delenv("EXL3TOOLS_GEMV_HALVES")
    on = {cb: cuda_build.cubin_path(6, cb).name for cb in (0, 1, 2)}
    assert on[0] != off[0] and on[1] != off[1] and on[2] == off[2]
    monkeypatch.delenv("EXL3TOOLS_GEMV_AFFINE")              # MUL1's AFF kernels: the default
    aff = {cb: cuda_build.cubin_path(6, cb).name for cb in (0, 1, 2)}
    assert aff[2] not in (off[2], on[0], on[1]) and (aff[0], aff[1]) == (on[0], on[1])
    monkeypatch.setenv("EXL3TOOLS_BATCH_INVARIANT", "1")     # one arithmetic for every row count
    assert {cb: cuda_build.cubin_path(6, cb).name for cb in (0, 1, 2)} == off


def test_gemv_defines_name_their_own_cubins_and_refuse_anything_else(monkeypatch):
    """EXL3TOOLS_GEMV_DEFINES (a tuning A/B's build constants) is part of the cache key, and only
    -DNAME[=integer] flags pass (the value reaches an nvcc command line)."""
    from exl3tools.kernels import cuda_build

    from exl3tools.errors import UsageError

    monkeypatch.delenv("EXL3TOOLS_GEMV_DEFINES", raising=False)
    plain = cuda_build.cubin_path(6, 2).name
    monkeypatch.setenv("EXL3TOOLS_GEMV_DEFINES", "-DPRO_P=2 -DPRO_MINB=9")
    assert cuda_build.cubin_path(6, 2).name not in (plain, cuda_build.cubin_path(6, 0).name)
    monkeypatch.setenv("EXL3TOOLS_GEMV_DEFINES", "-DPRO_MINB=0x7 -DXDUP_SMEM=1")   # hex passes
    assert cuda_build.extra_defines() == ("-DPRO_MINB=0x7", "-DXDUP_SMEM=1")
    assert (cuda_build.extra_define("PRO_MINB"), cuda_build.extra_define("XDUP_SMEM")) == (7, 1)
    monkeypatch.setenv("EXL3TOOLS_GEMV_DEFINES", "-DPRO_MINB=0x7,-DXDUP_SMEM=1")   # commas (TEST_ENVS)
    assert cuda_build.extra_defines() == ("-DPRO_MINB=0x7", "-DXDUP_SMEM=1")
    monkeypatch.setenv("EXL3TOOLS_GEMV_DEFINES", "-DXDUP_SMEM -DPRO_P=2")   # as nvcc reads them
    assert (cuda_build.extra_define("XDUP_SMEM"), cuda_build.extra_define("PRO_MINB")) == (1, 0)
    for bad in ("-DPRO_P=2;touch x", "-o /tmp/x", "-DPRO_P=$(id)", "-DPRO_MINB=0xZZ"):
        monkeypatch.setenv("EXL3TOOLS_GEMV_DEFINES", bad)
        with pytest.raises(UsageError, match="EXL3TOOLS_GEMV_DEFINES"):
            cuda_build.cubin_path(6, 2)


@functools.lru_cache(maxsize=None)
def _ptxas_report(cb: int, defines: tuple[str, ...]) -> tuple[int, str]:
    """(nvcc's status, ptxas's report) of one build, made once a session: three tests read the
    plain MUL1 build's (~16 s of nvcc each on 2 busy cores)."""
    from exl3tools.kernels import cuda_build

    with tempfile.TemporaryDirectory() as d:
        res = subprocess.run(["nvcc", *cuda_build.FLAGS, "-Xptxas", "-v", "-DK2=6", f"-DCB={cb}", "-DHALVES=1",
                              *defines, str(cuda_build.SRC), "-o", str(Path(d) / "g.cubin")],
                             capture_output=True, text=True)
    return res.returncode, res.stderr


def _ptxas(cb: int, *defines: str, entries: str = "exl3_gemv_pro_") -> tuple[str, dict[str, int]]:
    """exl3_gemv.cu's halves build at K 3 (K2 6) for codebook id ``cb`` compiled for sm_90a with
    ``defines``, asserted to build without spills: (ptxas's report, registers of each entry whose
    name starts with ``entries``)."""
    rc, report = _ptxas_report(cb, defines)
    assert rc == 0, report[-2000:]
    props = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert props and all(p == ("0", "0") for p in props), report[-2000:]
    regs = re.findall(rf"Compiling entry function '({entries}\w+)'.*?Used (\d+) registers", report, re.S)
    return report, {f: int(r) for f, r in regs}


def _on_a_gpu_machine() -> bool:
    import torch

    return shutil.which("nvcc") is not None and torch.cuda.is_available()


# a tuning A/B's defines (EXL3TOOLS_GEMV_DEFINES): each build is ~17 s of nvcc on one core (~70 s
# of a 2-core CI run for four), so these are checked where such an A/B runs, on the GPU machine
# (bench/gpu_all.sh's tests stage runs this file beside tests/gpu)
tuning_build = pytest.mark.skipif(not _on_a_gpu_machine(),
                                  reason="a tuning define's ptxas build: on the GPU machine (nvcc and CUDA)")


@tuning_build
def test_the_one_row_kernels_take_their_stage_and_block_defines():
    """PRO_P / PRO_MINB reach the GEMV_PRO* kernels, pair and AFF: two k-tiles in flight at 9
    blocks an SM compile to at most 56 registers without spills (the default: 72 at 7)."""
    _, regs = _ptxas(2, "-DPRO_P=2", "-DPRO_MINB=9")
    assert {"exl3_gemv_pro_m8_t2_f16", "exl3_gemv_pro_aff_m8_t2_f16", "exl3_gemv_pro_act_aff_m8_t2_f32"} <= set(regs)
    assert all(r <= 56 for r in regs.values()), regs


@tuning_build
@pytest.mark.parametrize("cb", [0, 1, 2])
def test_xdup_smem_builds_without_spills_at_six_blocks(cb):
    """XDUP_SMEM (the activations kept in shared memory as the B words they feed; a tuning A/B's
    define) with PRO_MINB 6 builds every kernel without spills at K 3 (at 7 blocks an SM, or
    unbounded, 3INST's act kernels and MUL1's AFF ones spill 12-16 bytes)."""
    _, regs = _ptxas(cb, "-DXDUP_SMEM=1", "-DPRO_MINB=6")
    one_row = "exl3_gemv_pro_aff_m8_t2_f16" if cb == 2 else "exl3_gemv_pro_m8_t2_f16"
    assert regs[one_row] <= 80, regs


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles for sm_90a, no GPU)")
@pytest.mark.parametrize("cb", [0, 1, 2])
def test_the_halves_gemv_builds_without_spills(cb):
    """exl3_gemv.cu with -DHALVES=1 (3INST, MCG; MUL1's AFF kernels): the 8-row gemv kernels compile
    for sm_90a without spills (a tile takes two MMAs there: the halves as k entries); MUL1's module
    has the gemv_pro entry points cuda_gemv.gemv_pro names for AFF, the others have none."""
    report, _ = _ptxas(cb)
    aff = {f for f in re.findall(r"Compiling entry function '(\w+)'", report) if "_aff_" in f}
    want = {f"exl3_gemv_pro_{kind}aff_m8_t2_{x}" for kind in ("", "ld_", "act_") for x in ("f16", "f32")}
    assert aff == (want if cb == 2 else set())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles for sm_90a, no GPU)")
def test_every_hadamard_pass_has_its_grid_kernel():
    """cuda_gemv.had_in / had_out launch exl3_had_*_grid, the 1-D passes under EXL3TOOLS_HAD_GRID=0:
    each of the ten 1-D passes has its twin, built without spills in no more registers than 32
    (8 blocks of 256 threads an SM, as the 1-D passes)."""
    _, regs = _ptxas(2, entries="exl3_had_")
    flat = {f for f in regs if not f.endswith("_grid")}
    assert len(flat) == 10 and {f"{f}_grid" for f in flat} == set(regs) - flat, sorted(regs)
    assert all(regs[f"{f}_grid"] <= 32 for f in flat), regs


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compiles for sm_90a, no GPU)")
def test_no_wgmma_kernel_has_its_mmas_serialized():
    """ptxas serializes a kernel's asynchronous MMAs (C7512 / C7515: each one waited for at once)
    when registers run short or other instructions touch the accumulators while they run; it still
    compiles, just slowly. exl3_wgr_m256_t2 hit both while written (four A operands in 288 threads;
    thread 0's copies inside a 256-thread loop): it keeps within the 168 registers a thread of its
    288-thread block (ptxas rounds to whole warpgroups) with its MMAs asynchronous."""
    report, regs = _ptxas(2, entries="exl3_w")
    assert "are serialized" not in report, [ln for ln in report.splitlines() if "serialized" in ln]
    wgr = {"exl3_wgr_m256_t2", "exl3_wgr_sk_m256_t2", "exl3_wgr_out_m256_t2_f16", "exl3_wgr_out_m256_t2_f32",
           "exl3_wgr_rg_out_m256_t2_f16", "exl3_wgr_rg_out_m256_t2_f32", "exl3_wgr_rg_out_m128_t2_f16",
           "exl3_wgr_rg_out_m128_t2_f32"}
    assert {"exl3_wga_m256_t2", "exl3_wg2_m256_t1"} | wgr <= set(regs), sorted(regs)
    assert all(regs[f] <= 168 for f in wgr), regs
