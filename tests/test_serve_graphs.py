"""exl3tools serve with the fixed-shape decode step over the paged KV cache (runtime/paged_decode.py,
forced on the CPU without CUDA graphs) against the eager paged server: a real uvicorn server on
127.0.0.1, the official openai client, greedy decoding, the same tokens; a repeated prompt is served
from the prefix cache (usage.prompt_tokens_details.cached_tokens) with the same tokens."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, in a land far", "1, 2, 3,"]
KW = dict(model="demo", max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def _run(cuda_graphs):
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=96,
                      cuda_graphs=cuda_graphs, block_size=8)
    app = create_app(cfg)
    with LiveServer(app) as s:
        runner = app.state.server.engine.runner
        assert runner.decode_mode == ("static" if cuda_graphs else "eager")
        steps = []
        if runner.paged.decoder is not None:   # count the batched decode steps that took the static path
            step = runner.paged.decoder.step
            runner.paged.decoder.step = lambda *a: steps.append(len(a[0])) or step(*a)
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        pieces, ids = [], []
        for chunk in client.completions.create(prompt=PROMPTS[0], stream=True, **KW):
            for c in chunk.choices:
                pieces.append(c.text)
                ids.extend(c.model_dump().get("token_ids") or [])
        # three requests at once: prefills and decodes interleave in the engine's batches
        with cf.ThreadPoolExecutor(3) as pool:
            many = list(pool.map(lambda p: client.completions.create(prompt=p, **KW), PROMPTS))
        # a long repeated prompt: whole blocks come from the prefix cache, the tokens do not change
        long = " ".join(["The quick brown fox jumps over the lazy dog."] * 4)
        first, again = (client.completions.create(prompt=long, **KW) for _ in range(2))
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens >= 16
        assert again.model_dump()["choices"][0]["token_ids"] == first.model_dump()["choices"][0]["token_ids"]
        assert runner.cache_tokens_used() == 0
        if runner.paged.decoder is not None:
            assert len(steps) >= 10 and max(steps) >= 2, steps
        return "".join(pieces), ids, [r.model_dump()["choices"][0]["token_ids"] for r in many]


def test_static_decode_server_streams_the_eager_tokens():
    eager = _run(False)
    static = _run("force")
    assert len(eager[1]) == 6 and len(eager[2]) == 3
    assert static == eager
