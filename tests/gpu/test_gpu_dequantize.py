"""GPU decode for dequantize / validate --deep (kernels/gpu_decode.py) against the CPU reference.

W on the GPU must equal kernels/reference.py rotate_out_chain (in-order float32 FMA chains) bit for
bit, and decode_linear (BLAS) bit for bit where the host's BLAS sums that way
(reference.blas_is_fma_chain()), else within float32 rounding. The Hadamard kernel runs on CUDA or
on the Triton CPU interpreter (TRITON_INTERPRET=1); the rest needs CUDA (Ŵ from cuda_exl3): every
K x codebook, every linear of every fixture, and the CLI end to end.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from exl3tools.kernels import reference as ref

from tests.conftest import DEMO, FIXTURE_NAMES, cuda_available, fixture_dir
from tests.gpu.kernel_cases import CASES, random_linear

cuda = pytest.mark.skipif(not cuda_available(), reason="needs CUDA")


def _same_w(got, want, what=""):
    """decode_linear's W: the same bits where the host BLAS is an FMA chain, else float32 rounding."""
    if ref.blas_is_fma_chain():
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), what
    else:
        assert np.allclose(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max()), what


@pytest.mark.parametrize("kt,nt,width,cb", [(16, 24, 48, "mul1"), (8, 8, 40, "3inst"), (24, 8, 64, "mcg")])
def test_hadamards_equal_reference_bit_for_bit(dev, kt, nt, width, cb):
    import torch
    from exl3tools.kernels.gpu_decode import rotate_out_t

    rng = np.random.default_rng(kt * nt + width)
    tr = rng.integers(-32768, 32768, size=(kt, nt, width), dtype=np.int16)
    # scales over several binades so the product roundings differ from one element to the next
    suh = (rng.standard_normal(16 * kt) * rng.choice([1e-3, 1.0, 30.0], 16 * kt)).astype(np.float16)
    svh = rng.standard_normal(16 * nt).astype(np.float16)
    what = ref.decode_rotated(tr, cb)
    got = rotate_out_t(torch.from_numpy(np.ascontiguousarray(what.T)).to(dev),
                       torch.from_numpy(suh).to(dev), torch.from_numpy(svh).to(dev)).cpu().numpy()
    assert np.array_equal(got.view(np.uint32), ref.rotate_out_chain(what, suh, svh).T.view(np.uint32))
    _same_w(got, ref.decode_linear(tr, suh, svh, cb).T)


@pytest.fixture(scope="module")
def gpu():
    if not cuda_available():
        pytest.skip("needs CUDA")
    from exl3tools.kernels import cuda_build
    from exl3tools.kernels.gpu_decode import GpuDecoder

    cuda_build.prebuild()
    return GpuDecoder("cuda")


@cuda
@pytest.mark.parametrize("width,cb", CASES)
def test_every_k_and_codebook_bit_exact(gpu, width, cb):
    rng = np.random.default_rng(width * 3 + len(cb))
    tr, suh, svh, _ = random_linear(rng, 384, 640, width)
    want = ref.rotate_out_chain(ref.decode_rotated(tr, cb), suh, svh)
    got = gpu.decode_linear(tr, suh, svh, cb)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    _same_w(got, ref.decode_linear(tr, suh, svh, cb))
    # the HF-layout bytes dequantize writes, in every output dtype
    from exl3tools.dequantize import to_dtype_bytes

    for odt in ("F32", "F16", "BF16"):
        assert gpu.hf_rows_bytes(tr, suh, svh, cb, 576, 320, odt) == to_dtype_bytes(want[:320, :576].T, odt)


@cuda
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_fixture_linear_bit_exact(gpu, name):
    from exl3tools.checkpoint import Checkpoint
    from exl3tools.layout import scan

    ck = Checkpoint.open(fixture_dir(name) / "model")
    sc = scan({n: (r.dtype, r.shape) for n, r in ck.tensors.items()})
    seen = set()
    for p, lin in sc.linears.items():
        tr, suh, svh = (ck.read_numpy(f"{p}.{s}") for s in ("trellis", "suh", "svh"))
        got = gpu.decode_linear(tr, suh, svh, lin.codebook)
        _same_w(got, ref.decode_linear(tr, suh, svh, lin.codebook), p)
        seen.add((tr.shape[-1], lin.codebook))
    assert seen


def _files(d):
    return {f.relative_to(d).as_posix(): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


@cuda
@pytest.mark.parametrize("model,dtype", [(DEMO / "model", "bf16"), ("glm5_moe_dsa-3.0bpw-mul1", "fp32"),
                                         ("llama-4.0bpw-mul1", "fp16")])
def test_cli_dequantize_cuda_writes_the_cpu_bytes(gpu, tmp_path, model, dtype):
    from exl3tools.cli import main

    if not ref.blas_is_fma_chain():
        pytest.skip("this host's BLAS is not an in-order FMA chain: CPU and GPU W agree to float32 "
                    "rounding only (test_every_fixture_linear_bit_exact), so their bytes may differ")
    src = model if not isinstance(model, str) else fixture_dir(model) / "model"
    outs = {}
    for device in ("cuda", "cpu"):
        r = CliRunner().invoke(main, ["dequantize", str(src), str(tmp_path / device), "--dtype", dtype,
                                      "--device", device, "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["device"] == device
        outs[device] = _files(tmp_path / device)
    assert outs["cuda"].keys() == outs["cpu"].keys()
    for name, data in outs["cpu"].items():
        assert outs["cuda"][name] == data, name


@cuda
def test_cli_validate_deep_cuda_same_findings(gpu):
    from exl3tools.cli import main

    src = fixture_dir("glm4_moe-3.0bpw-mcg") / "model"
    docs = {}
    for device in ("cuda", "cpu"):
        r = CliRunner().invoke(main, ["validate", str(src), "--deep", "--json", "--device", device])
        assert r.exit_code in (0, 1), r.output
        docs[device] = json.loads(r.output)
    assert docs["cuda"]["findings"] == docs["cpu"]["findings"]
    assert docs["cuda"]["stats"]["decoded_linears"] == docs["cpu"]["stats"]["decoded_linears"] > 0
