"""exl3tools plan against what the runtime really allocates on the GPU (docs/plan.md), and the
preflight refusal of serve/generate through the real CLI on the real GPU. Skipped without CUDA.

What the runtime holds on the device is found by walking the model (attributes, containers,
closures) for CUDA tensors, one entry per storage:

- weights: exactly ``weight_bytes + fp32_copy_bytes`` of the plan, less the codebook markers (0-d
  int32 ``mcg``/``mul1``, read and checked on the host, never kept); norms, routers and score biases
  move to the device on the first forward, so this is checked after one step;
- besides: the CUDA backend's pointer tables (``*_tab``, int64, 8 bytes per trellis/suh/svh/bias
  pointer of a linear or of a grouped expert projection), the grouped experts' ``lut`` and each
  attention's ``inv_freq`` (both derived, not checkpoint bytes);
- right after loading (before any forward: no cuBLAS workspace, no kernel workspace yet) the caching
  allocator's ``requested_bytes`` grew by exactly the walked tensors plus the KV pool, and
  ``memory_allocated`` by the same with every allocation rounded up to 512 bytes (a large block
  may keep up to 1 MiB more when the allocator does not split it).

The KV pool is sized by ``max_cache_tokens`` (small: several test processes share the GPU) and is
exactly the plan's ``kv_bytes_per_token`` for those tokens plus one block (the block manager's
scratch block).
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import types

import pytest

from tests.conftest import REPO, cuda_available, fixture_dir
from tests.gpu.conftest import cuda_backend

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs CUDA")

NAMES = ["glm4_moe-3.0bpw-mcg", "llama-4.0bpw-mul1", "qwen3_moe-2.5bpw-mul1", "synth-small"]
TOKENS = 4096
BLOCK = 16
MARKERS = ("mcg", "mul1")
DERIVED = ("inv_freq", "lut")


@pytest.fixture(scope="module")
def synth_small(tmp_path_factory):
    sys.path.insert(0, str(REPO / "bench"))
    import synth_checkpoint as sc

    out = tmp_path_factory.mktemp("synth") / "small"
    sc.write_checkpoint(out, small=True)
    return out


@pytest.fixture(params=NAMES)
def model_dir(request):
    if request.param == "synth-small":
        return request.getfixturevalue("synth_small")
    return fixture_dir(request.param) / "model"


def device_tensors(root) -> dict[int, tuple[str, int]]:
    """{storage pointer: (attribute or key name, storage bytes)} of every CUDA tensor reachable from
    ``root`` through exl3tools objects' attributes, containers, closures and bound methods."""
    import torch

    out: dict[int, tuple[str, int]] = {}
    seen: set[int] = set()
    stack = [("", root)]
    while stack:
        name, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda:
                st = obj.untyped_storage()
                out.setdefault(st.data_ptr(), (name, st.nbytes()))
        elif isinstance(obj, dict):
            stack += [(k if isinstance(k, str) else name, v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(name, v) for v in obj]
        elif isinstance(obj, types.MethodType):
            stack.append((name, obj.__self__))
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    stack.append((name, cell.cell_contents))
                except ValueError:      # an empty cell
                    pass
        elif type(obj).__module__.startswith("exl3tools"):
            if hasattr(obj, "__dict__"):
                stack += list(vars(obj).items())
            for cls in type(obj).__mro__:
                for s in getattr(cls, "__slots__", ()):
                    if hasattr(obj, s):
                        stack.append((s, getattr(obj, s)))
    return out


def _kind(name: str) -> str:
    return "table" if name.endswith("_tab") else "derived" if name in DERIVED else "weight"


def _sum(held, kind: str) -> int:
    return sum(n for name, n in held.values() if _kind(name) == kind)


def test_plan_bytes_are_what_the_runtime_allocates(model_dir):
    import torch

    from exl3tools.checkpoint import Checkpoint
    from exl3tools.plan import plan_memory
    from exl3tools.runtime.runner import load_runner

    backend = cuda_backend()
    ck = Checkpoint.open(model_dir)
    total = torch.cuda.mem_get_info()[1]
    rank = plan_memory(ck, gpu="cuda", gpu_total=total, block_size=BLOCK, kv_dtype="auto").ranks[0]
    markers = sum(ref.info.nbytes for n, ref in ck.tensors.items() if n.rsplit(".", 1)[-1] in MARKERS)
    dev = torch.device("cuda", torch.cuda.current_device())

    gc.collect()
    torch.cuda.synchronize(dev)
    req0 = torch.cuda.memory_stats(dev).get("requested_bytes.all.current")
    alloc0 = torch.cuda.memory_allocated(dev)
    runner = load_runner(model_dir, device="cuda", backend=backend, max_cache_tokens=TOKENS, max_num_seqs=1,
                         block_size=BLOCK, decode="eager", prefix_caching=False)
    try:
        torch.cuda.synchronize(dev)
        req1 = torch.cuda.memory_stats(dev).get("requested_bytes.all.current")
        alloc1 = torch.cuda.memory_allocated(dev)
        held = device_tensors(runner.model)
        pool = runner.paged.pool
        pool_sizes = [t.untyped_storage().nbytes() for layer in pool.planes for t in layer.values()]
        sizes = [n for _, n in held.values()] + pool_sizes
        where = (f"{model_dir.name if model_dir.name != 'model' else model_dir.parent.name}: weights "
                 f"{_sum(held, 'weight')} + tables {_sum(held, 'table')} + derived {_sum(held, 'derived')} "
                 f"+ KV pool {sum(pool_sizes)} = {sum(sizes)}")

        # the allocator saw exactly these tensors while loading
        if req0 is not None:
            assert req1 - req0 == sum(sizes), f"requested {req1 - req0} B, {where}"
        rounded = sum(-(-max(n, 1) // 512) * 512 for n in sizes)
        large = sum(n > 2**20 for n in sizes)
        assert rounded <= alloc1 - alloc0 <= rounded + large * 2**20, f"allocated {alloc1 - alloc0} B, {where}"

        # KV: the plan's bytes per token for these tokens, plus the scratch block
        per = rank.kv_bytes_per_token
        assert pool.dtype == torch.bfloat16
        assert sum(pool_sizes) == pool.nbytes() == (-(-TOKENS // BLOCK) + 1) * BLOCK * per, where
        assert 0 < pool.nbytes() - TOKENS * per <= BLOCK * per

        # weights: after one step everything the model keeps is on the device
        runner.add_sequence("warm")
        runner.step([("warm", [1, 2, 3])])
        runner.free_sequence("warm")
        torch.cuda.synchronize(dev)
        held = device_tensors(runner.model)
        assert _sum(held, "weight") == rank.weight_bytes + rank.fp32_copy_bytes - markers, (
            f"plan {rank.weight_bytes} + fp32 copies {rank.fp32_copy_bytes} - markers {markers}; "
            f"held: weights {_sum(held, 'weight')}, tables {_sum(held, 'table')}, derived {_sum(held, 'derived')}")
        tables = [(name, n) for name, n in held.values() if _kind(name) == "table"]
        assert tables and all(n % 8 == 0 for _, n in tables)
    finally:
        runner.close()
        del runner
        gc.collect()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ refusal through the real CLI
def _cli(*args: str):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        return subprocess.run([sys.executable, "-m", "exl3tools.cli", *args], capture_output=True, text=True,
                              timeout=180, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"exl3tools {' '.join(args)}: no refusal within 180 s (did it load the model?)")


def _refusal(res, *, must: list[str]) -> str:
    import torch

    assert res.returncode == 3, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if "does not fit on" in x]
    assert len(lines) == 1, res.stderr[-2000:]
    line = lines[0]
    gpu = torch.cuda.get_device_name(0)
    assert f"[{gpu}]" in line, line                                         # names the GPU
    assert re.search(r"\(\d+\.\d\d GiB\): rank 0 needs \d+\.\d+ (GiB|MiB) \(weights ", line), line   # and the bytes
    assert re.search(r"\d+\.\d+ (GiB|MiB) free at --gpu-memory-utilization", line), line
    for m in must:
        assert m in line, (m, line)
    return line


def test_serve_refuses_an_impossible_gpu_memory_utilization():
    src = str(fixture_dir("llama-4.0bpw-mul1") / "model")
    res = _cli("serve", src, "--device", "cuda", "--port", "0", "--gpu-memory-utilization", "0.005")
    _refusal(res, must=["free at --gpu-memory-utilization 0.005", "KV for 16 tokens"])


def test_serve_refuses_an_impossible_max_model_len():
    src = str(fixture_dir("llama-4.0bpw-mul1") / "model")
    res = _cli("serve", src, "--device", "cuda", "--port", "0", "--max-model-len", "1000000000")
    _refusal(res, must=["KV for 1000000000 tokens", "free at --gpu-memory-utilization 0.9"])


def test_generate_refuses_a_checkpoint_bigger_than_the_gpu(tmp_path):
    """164 GB of (sparse) weights on one GPU: refused from the headers, nothing is read."""
    from tests.test_plan_sparse import write_huge

    out = tmp_path / "huge"
    write_huge(out)
    res = _cli("generate", str(out), "--token-ids", "1,2", "--device", "cuda", "--max-tokens", "1")
    _refusal(res, must=["weights 152.65 GiB", "free at --gpu-memory-utilization 0.9"])
