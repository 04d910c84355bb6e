"""Shared test helpers: where the fixtures are, the demo checkpoint, a `gpu` skip."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# a developer's or CI shell's API key would close every server the tests start (their clients send
# none); tests that need a key set it themselves (monkeypatch, or the subprocess's env)
for _var in ("EXL3TOOLS_SERVE_API_KEY", "EXL3TOOLS_SERVE_API_KEYS", "VLLM_API_KEY"):
    os.environ.pop(_var, None)

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "demo" / "glm4_moe-3.0bpw-mcg"
FIXTURES = Path(os.environ.get("EXL3TOOLS_FIXTURES", REPO.parent / "shared" / "fixtures"))
FIXTURE_NAMES = [
    "llama-4.0bpw-mul1", "qwen3_moe-2.5bpw-mul1", "glm4_moe-3.0bpw-mcg", "deepseek_v3-3.0bpw-3inst",
    "glm5_moe_dsa-3.0bpw-mul1", "glm4_moe-tp-2.0bpw-mul1", "glm5_moe_dsa-tp-4.0bpw-mcg",
]


def fixture_dir(name: str) -> Path:
    """The shared fixture folder, or skip with a clear message when it is absent."""
    d = FIXTURES / name
    if not (d / "model" / "config.json").is_file():
        pytest.skip(f"shared fixture {name} not found under {FIXTURES} (set EXL3TOOLS_FIXTURES)")
    return d


# "synth-ARCH": bench/synth_checkpoint.py --arch ARCH --small, a name for model_dir, not a fixture
# folder. DeepSeek-V3 with its MTP layer, which no fixture has (exllamav3's converter drops it):
DSV3_MTP = "synth-deepseek_v3"
# "+OPTION" after the arch: more synth_checkpoint.py options ("--OPTION"). A fixed top-k a layer,
# no routing near-ties (what the GPU's token-by-token comparisons of two loads need):
DSV3_DECISIVE = "synth-deepseek_v3+decisive-router"


@pytest.fixture(scope="session")
def synth_small(tmp_path_factory):
    """``make(arch, *options) -> Path``: a ``bench/synth_checkpoint.py --arch ARCH --small``
    checkpoint, written once per session (per xdist worker) for each (arch, options)."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import synth_checkpoint as sc

    made: dict[tuple[str, ...], Path] = {}

    def make(arch: str, *options: str) -> Path:
        key = (arch, *options)
        if key not in made:
            out = tmp_path_factory.mktemp("synth") / arch
            assert sc.main([str(out), "--arch", arch, "--small", *options]) == 0
            made[key] = out
        return made[key]

    return make


def model_dir(name: str, request) -> Path:
    """The model folder of ``name``: a shared fixture's, or (``synth-ARCH[+OPTION...]``) a synthetic
    checkpoint's, written with ``--OPTION`` for each OPTION."""
    if name.startswith("synth-"):
        arch, *flags = name.removeprefix("synth-").split("+")
        return request.getfixturevalue("synth_small")(arch, *(f"--{f}" for f in flags))
    return fixture_dir(name) / "model"


def golden_prompt(model: Path, key: str, n: int) -> list[int]:
    """The first ``n`` tokens of prompt ``key`` of the fixture goldens beside ``model``; tokens
    3 .. n + 2 where there are none (a synthetic checkpoint)."""
    gold = model.parent / "goldens_logits.safetensors"
    if not gold.is_file():
        return list(range(3, n + 3))
    from safetensors.torch import load_file

    return load_file(str(gold))[key].tolist()[:n]


def speculate_beside_plain(r, prompt: list[int], n: int, k: int = 2) -> tuple[list[int], list[int]]:
    """On runner ``r``: greedy speculative decoding of sequence 0 (``k`` MTP drafts, then one verify
    step) beside a plain greedy row, sequence 1, fed the same prompt. Returns sequence 0's first
    ``n``-or-more tokens and the plain row's tokens meanwhile (one per verify step)."""
    from exl3tools.runtime import sampling

    r.add_sequence(0)
    r.add_sequence(1, speculative=False)
    out = [int(r.step([(0, prompt)])[0].argmax())]
    plain = [int(r.step([(1, prompt)])[0].argmax())]
    while len(out) < n:
        drafts, qrows = r.draft(0, out[-1], k, lambda row: int(row.argmax()))
        target = r.verify([(0, [out[-1]] + drafts)])
        a, bonus = sampling.accept_drafts(target, qrows, drafts, 0.0, 0, 1.0, None)
        r.accept(0, a + 1)
        out += drafts[:a] + [bonus]
        plain.append(int(r.step([(1, [plain[-1]])])[0].argmax()))
    return out, plain


@pytest.fixture(params=FIXTURE_NAMES)
def fixture(request) -> Path:
    return fixture_dir(request.param)


@pytest.fixture
def demo_dir() -> Path:
    return DEMO


@pytest.fixture(scope="module")
def demo_openai():
    """The official openai client on a real server of the demo checkpoint (name "demo", 256-token
    context), one server per test module."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer

    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_context=256))
    with LiveServer(app) as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)


def special_tokens(data: dict, contents: tuple[str, ...]) -> dict:
    """A tokenizer.json (``data``) in which ``contents`` are special added tokens at the top ids of
    the model's vocabulary (as a real checkpoint's markers are: within the embedding), the BPE
    entries they replace and the merges that made those dropped."""
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    top = max(by_id)
    gone = set()
    for k, content in enumerate(contents):
        i = top - k
        gone.add(by_id[i])
        del vocab[by_id[i]]
        vocab[content] = i
        data["added_tokens"].append({"id": i, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    parts = [m.split(" ") if isinstance(m, str) else m for m in data["model"]["merges"]]
    data["model"]["merges"] = [m for m, p in zip(data["model"]["merges"], parts, strict=True)
                               if not (set(p) & gone or "".join(p) in gone)]
    return data


@pytest.fixture
def scripted(tmp_path):
    """``start(template, text, special=(), **config)``: the openai client on a server of a copy of the
    demo checkpoint with ``template`` as its chat template (``special``: these strings special
    tokens of its tokenizer; ServeConfig ``config`` beside it), whose
    sampler emits ``text`` (tokenized) and EOS whatever the logits: what a real model writes (its
    call syntax, its thinking), which a random one never would, through the real engine,
    detokenizer and formatter."""
    import shutil
    from contextlib import ExitStack

    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from tokenizers import Tokenizer

    from exl3tools.server.app import ServeConfig, create_app, runtime_hooks
    from exl3tools.server.testing import LiveServer

    stack = ExitStack()

    def start(template: str, text: str, special: tuple[str, ...] = (), **config):
        dst = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(DEMO / "model", dst)
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        if special:
            tj = dst / "tokenizer.json"
            tj.write_text(json.dumps(special_tokens(json.loads(tj.read_text()), special)))
        eos = json.loads((dst / "config.json").read_text())["eos_token_id"]
        script = (Tokenizer.from_file(str(dst / "tokenizer.json")).encode(text, add_special_tokens=False).ids
                  + [eos if isinstance(eos, int) else eos[0]])
        drawn: dict[int, int] = {}

        def sample(_row, _temperature, _top_k, _top_p, generator):
            # each sequence (sampled: a generator of its own) writes the script from its start
            i = drawn[id(generator)] = drawn.get(id(generator), -1) + 1
            return script[min(i, len(script) - 1)]
        hooks = dict(runtime_hooks(), sample=sample, sample_batch=None, sample_device=None)
        app = create_app(ServeConfig(model_path=str(dst), served_model_name="demo", max_context=512, **config),
                         hooks=hooks)
        s = stack.enter_context(LiveServer(app))
        return openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)

    with stack:
        yield start


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def __getattr__(name: str):
    """``gpu``: a skip without CUDA, made when a test module imports it (module __getattr__), so
    that a pytest process whose tests need no torch (test_gpu_all_script.py's child run) does not
    import it here (~2 s)."""
    if name == "gpu":
        return pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `make test` runs `-n 2 --dist loadfile`: a worker that runs dry takes the next whole file, and xdist
# queues the files by their count of tests (--loadscope-reorder, on by default), so files of a few
# tests that run for a minute (TP ranks, servers, nvcc, the interpreter) came last and one worker ran
# ~30 s past the other. These go first instead, longest first (CPU suite, 2 cores, 2026-12-07); a
# file not listed keeps its place after them, so a stale entry costs balance, never a test.
SLOW_FILES_FIRST = (
    "tests/test_mla_static_decode.py", "tests/test_cuda_bit_logic.py", "tests/test_server_cli.py",
    "tests/test_serve_speculative.py", "tests/gpu/test_triton_kernels.py", "tests/test_fused_decode.py",
    "tests/test_runtime_tp.py", "tests/gpu/test_mla_attention.py", "tests/test_long_steps.py",
    "tests/test_serve_speculative_tp.py", "tests/test_mla_absorb.py", "tests/test_runtime_mla_tp.py",
    "tests/test_runtime_mla.py", "tests/gpu/test_fused_decode_gpu.py", "tests/test_fused_eager.py",
    "tests/test_server_load.py", "tests/test_bench_gpu_serve.py", "tests/test_serve_mla_exact.py",
)


def pytest_configure(config) -> None:
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False     # keep the order below (the controller schedules)


def pytest_collection_modifyitems(config, items) -> None:
    """SLOW_FILES_FIRST's files first, in its order; the rest as collected (a stable sort: each file's
    tests stay together and in their own order)."""
    rank = {path: i for i, path in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


_REPORT_LOG = os.environ.get("EXL3TOOLS_TEST_LOG")


def pytest_runtest_logreport(report) -> None:
    """With EXL3TOOLS_TEST_LOG set, append each failure (with its traceback) and each test over 10 s
    as it happens: a device call cut off by its time limit still says what failed and what was slow;
    and each finished test's node id to ``<log>.done`` (bench/gpu_all.sh lists the tests a cut run
    left, for the next call to run those alone)."""
    if not _REPORT_LOG or os.environ.get("PYTEST_XDIST_WORKER"):
        return   # under xdist the controller writes (workers forward their reports to it)
    if report.when == "teardown":
        with open(_REPORT_LOG + ".done", "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")
    if report.when != "call" and not report.failed:
        return
    with open(_REPORT_LOG, "a", encoding="utf-8") as f:
        if report.failed:
            f.write(f"FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
        elif report.duration > 10:
            f.write(f"SLOW {report.nodeid} {report.duration:.1f} s\n")
