"""/v1/completions with ``echo`` (OpenAI's legacy field): the prompt's text before the completion
and, with ``logprobs``, every prompt token's logprob (None for the first) before the completion's,
as lm-evaluation-harness's ``local-completions`` scores loglikelihood tasks (``echo: true,
logprobs: 1, max_tokens: 1``, or ``max_tokens: 0``). A real server on 127.0.0.1, the official
openai client; the reference is the plain CPU runtime's log-softmax over the same tokens."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import torch  # noqa: E402

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.planner import SCORED_CHUNK  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

TOL = 1e-4
LONG = [1] + [(7 * i) % 900 + 20 for i in range(SCORED_CHUNK + 40)]   # scored in two chunks
SHORT = [1, 50, 60, 70, 80]


def _reference(model, tokens: list[int]) -> tuple[list[float], list[int]]:
    """Each token's logprob after the ones before it (the first has none), and the argmax of each
    row before it, from one plain forward over every row."""
    logits = model.forward([(model.new_cache(), tokens)], all_logits=True).double()
    lp = torch.log_softmax(logits, -1)
    return ([lp[i, t].item() for i, t in enumerate(tokens[1:])], lp.argmax(-1).tolist())


@pytest.fixture(scope="module")
def server():
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=4, max_context=256,
                      block_size=8)
    app = create_app(cfg)
    with LiveServer(app) as s:
        yield s, app, openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_echo_scores_every_prompt_token_as_the_reference(server):
    _, app, client = server
    model = app.state.server.engine.runner.model
    ref, argmax = _reference(model, LONG)
    for _ in range(2):              # the second time the prompt's blocks are cached: still scored
        r = client.completions.create(model="demo", prompt=LONG, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                      extra_body={"return_token_ids": True})
        c = r.choices[0]
        lps = c.logprobs.token_logprobs
        assert len(lps) == len(LONG) + 1 and lps[0] is None and c.logprobs.top_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(lps[1:len(LONG)], ref, strict=True)) < TOL
        # lm-eval's greedy check: the top alternative of each scored row is the row's argmax
        tops = [max(d, key=d.get) for d in c.logprobs.top_logprobs[1:len(LONG)]]
        strs = app.state.server.token_text()
        assert tops == [strs.get(t)[0] for t in argmax[:len(LONG) - 1]]
        assert r.usage.prompt_tokens == len(LONG) and r.usage.completion_tokens == 1
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    # the completion's token after the prompt's: its logprob is the last row's
    full = LONG + c.model_dump()["token_ids"]
    assert abs(lps[-1] - _reference(model, full)[0][-1]) < TOL
    assert c.text.startswith(model_text(app, LONG))


def model_text(app, ids: list[int]) -> str:
    return app.state.server.runner.tokenizer.decode(ids, skip_special_tokens=False)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server):
    _, app, client = server
    model = app.state.server.engine.runner.model
    r = client.completions.create(model="demo", prompt=[SHORT, [1, 400]], max_tokens=0, logprobs=0, echo=True, n=2)
    assert [c.finish_reason for c in r.choices] == ["length"] * 4 and r.usage.completion_tokens == 0
    for c in r.choices:
        prompt = [SHORT, [1, 400]][c.index // 2]
        assert c.text == model_text(app, prompt)
        got = c.logprobs.token_logprobs
        assert got[0] is None and len(got) == len(prompt)
        assert max(abs(a - b) for a, b in zip(got[1:], _reference(model, prompt)[0], strict=True)) < TOL
    plain = client.completions.create(model="demo", prompt="Hello", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Hello" and plain.choices[0].logprobs is None


def test_streamed_echo_is_the_whole_response_in_pieces(server):
    _, _, client = server
    kw = dict(model="demo", prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kw).choices[0]
    text, lps = "", []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.text
            lps += c.logprobs.token_logprobs if c.logprobs else []
    assert text == whole.text and text.startswith("The capital of France is")
    assert lps == whole.logprobs.token_logprobs


def test_max_tokens_0_without_echo_is_a_400(server):
    _, _, client = server
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="demo", prompt="Hello", max_tokens=0)
