"""Shared test helpers: where the fixtures are, the demo checkpoint, a `gpu` skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


@pytest.fixture(params=FIXTURE_NAMES)
def fixture(request) -> Path:
    return fixture_dir(request.param)


@pytest.fixture
def demo_dir() -> Path:
    return DEMO


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


gpu = pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
