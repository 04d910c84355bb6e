"""exl3tools serve, end to end: a real uvicorn server on 127.0.0.1 over the demo checkpoint, driven
by the official openai client (and raw httpx where the wire format itself is under test)."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from exl3tools.server.app import ServeConfig, create_app  # noqa: E402
from exl3tools.server.testing import LiveServer  # noqa: E402
from tests.conftest import DEMO  # noqa: E402

MODEL = "demo"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def server():
    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name=MODEL))
    with LiveServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(resp: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


# ----------------------------------------------------------------------------- basics


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_returns_text_and_usage(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                                      temperature=0, extra_body={"ignore_eos": True})
    r = raw.parse()
    assert raw.headers["x-request-id"] == r.id
    assert r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_applies_the_template(client):
    from tokenizers import Tokenizer

    from exl3tools.server.template import ChatTemplate

    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    cfg = json.loads((DEMO / "model" / "tokenizer_config.json").read_text())
    text = ChatTemplate(cfg["chat_template"], bos_token="<s>", eos_token="</s>").render(MESSAGES)
    assert text.startswith("<s><|system|>\nBe brief.</s>\n<|user|>\nHello!</s>\n<|assistant|>\n")
    tok = Tokenizer.from_file(str(DEMO / "model" / "tokenizer.json"))
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False).ids)


def test_greedy_is_deterministic(client):
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text


# ----------------------------------------------------------------------------- streaming


def test_chat_stream_wire_format(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True, "seed": 1,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])


def test_stream_without_usage_has_no_usage_chunk(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["choices"] for e in events[:-1])


def _stream_chat(client, **kw):
    texts, finish, usage = {}, {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def _stream_completion(client, **kw):
    texts, finish, lps, usage = {}, {}, {}, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, lps, usage


def test_stream_equals_non_stream_for_the_same_seed_chat(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.95, seed=1234,
              n=2)
    full = client.chat.completions.create(**kw)
    texts, finish, usage = _stream_chat(client, **kw)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    # the second request may be served from the prefix cache: only cached_tokens may differ
    strip = lambda u: {k: v for k, v in u.model_dump().items() if k != "prompt_tokens_details"}  # noqa: E731
    assert strip(usage) == strip(full.usage)


def test_stream_equals_non_stream_for_the_same_seed_completion(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.8, top_k=50, seed=99, logprobs=2)
    kw["extra_body"] = {"top_k": 50}
    kw.pop("top_k")
    full = client.completions.create(**kw)
    texts, finish, lps, usage = _stream_completion(client, **kw)
    assert texts[0] == full.choices[0].text
    assert finish[0] == full.choices[0].finish_reason
    # a prefix-cache hit computes the prompt's tail alone: the same values up to float32 rounding
    assert lps[0] == pytest.approx(full.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert usage.completion_tokens == full.usage.completion_tokens


# ----------------------------------------------------------------------------- sampling


def test_seed_reproduces_and_different_seeds_differ(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.5,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    c = client.completions.create(seed=8, **kw)
    ids = lambda r: r.model_dump()["choices"][0]["token_ids"]  # noqa: E731
    assert ids(a) == ids(b) and a.choices[0].text == b.choices[0].text
    assert ids(a) != ids(c)  # 16 tokens at temperature 1.5 over 2048 ids: equal by chance ~never


def test_n_choices_are_indexed_and_independent(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=3, temperature=1.5,
                                  seed=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 30
    assert len({c.text for c in r.choices}) > 1
    # choice i of a seeded request is reproducible on its own
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=3, temperature=1.5,
                                      seed=5, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_cached_tokens_count_each_prompt_once_whatever_n(client):
    """prompt_tokens counts a prompt once whatever n; its cache hits must too (n choices each
    reported the hits: cached_tokens 4x the cached blocks, above prompt_tokens)."""
    msgs = [{"role": "user", "content": "a prompt long enough to fill two cache blocks " * 2}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    one = client.chat.completions.create(**kw)
    one = client.chat.completions.create(**kw)     # the prompt's full blocks now cached
    cached = one.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16
    many = client.chat.completions.create(n=4, **kw)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.prompt_tokens_details.cached_tokens == cached
    *_, usage = _stream_chat(client, n=4, **kw)
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_multiple_prompts_times_n(client):
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=3, n=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in r.choices}
    assert by[0] == by[1] and by[2] == by[3]  # greedy: the two choices of one prompt agree


def test_a_scoring_batch_past_64_prompts(client):
    """lm-eval's batched loglikelihood: many prompts in one completions request, echo + logprobs +
    max_tokens 0 (the cap was 64 prompts; --max-queue, 256 by default, bounds prompts x n)."""
    prompts = [f"{PROMPT} {i}" for i in range(80)]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert sorted(c.index for c in r.choices) == list(range(80))
    assert all(c.text == prompts[c.index] and c.logprobs.token_logprobs[0] is None for c in r.choices)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompts * 4, max_tokens=1)
    assert (e.value.body["code"], e.value.body["param"]) == ("too_many_sequences", "prompt")


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_text_offsets_index_the_text_across_byte_tokens(client):
    """Each token's text_offset is where its text starts in the choice's text, streamed or not,
    also past tokens shown as "bytes:\\xNN" (an emoji or CJK character over several byte tokens;
    the offsets once added up those display strings' lengths, and pointed past the text's end)."""
    target = "h\u00e9llo \U0001F600 \u65e5\u672c done"
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, logprobs=0,
              extra_body={"structured_outputs": {"choice": [target]}})
    r = client.completions.create(**kw)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == target and any(t.startswith("bytes:") for t in lp.tokens)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for tok, off in zip(lp.tokens, lp.text_offset, strict=True):
        if not tok.startswith("bytes:") and tok != "</s>":
            assert text[off:off + len(tok)] == tok
    streamed = [o for chunk in client.completions.create(stream=True, **kw) for c in chunk.choices
                if c.logprobs for o in c.logprobs.text_offset]
    assert streamed == lp.text_offset


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert bytes(t.bytes) == t.token.encode() or t.token.startswith("bytes:")


# ----------------------------------------------------------------------------- stopping


def _greedy(client, n_tokens=16):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=n_tokens, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].text, r.model_dump()["choices"][0]["token_ids"]


def test_stop_string_truncates_and_reports_stop(client):
    text, _ = _greedy(client)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop
    expected = text[: text.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    # streamed: the held-back prefix of the stop string never leaks
    texts, finish, _, _ = _stream_completion(client, model=MODEL, prompt=PROMPT, max_tokens=16,
                                             temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert texts[0] == expected and finish[0] == "stop"


def test_stop_token_ids(client):
    _, ids = _greedy(client, 8)
    target = ids[3]
    first = ids.index(target)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [target],
                                              "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.model_dump()["choices"][0]["token_ids"] == ids[: first + 1]
    assert r.usage.completion_tokens == first + 1


def test_max_tokens_one(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"


# ----------------------------------------------------------------------------- ops endpoints


def test_health_and_metrics(server, client):
    h = httpx.get(f"{server.url}/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("exl3tools_requests_total", "exl3tools_prompt_tokens_total",
                 "exl3tools_generation_tokens_total", "exl3tools_time_to_first_token_seconds_bucket",
                 "exl3tools_inter_token_latency_seconds_bucket", "exl3tools_queue_depth",
                 "exl3tools_running_sequences", "exl3tools_kv_cache_usage_ratio"):
        assert name in text, name
    assert 'exl3tools_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'exl3tools_model_ready{model="demo"} 1.0' in text


def test_errors_are_openai_shaped_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10**9)
    assert e.value.code == "context_length_exceeded"


# ----------------------------------------------------------------------------- auth


def test_api_key_required_but_health_open():
    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name=MODEL,
                                 api_keys=("k1", "k2")))
    with LiveServer(app) as s:
        bad = openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        metrics = httpx.get(f"{s.url}/metrics")       # open, as vLLM's: Prometheus scrapers send no key
        assert metrics.status_code == 200 and "exl3tools_requests_total" in metrics.text
        assert httpx.get(f"{s.url}/health").status_code == 200
        # vLLM's open /ping (GET and POST, SageMaker's probe) and /version
        assert [httpx.request(m, f"{s.url}/ping").json()["status"] for m in ("GET", "POST")] == ["ok", "ok"]
        from exl3tools import __version__
        assert httpx.get(f"{s.url}/version").json() == {"version": __version__}
        assert httpx.get(f"{s.url}/v1/models", headers={"x-api-key": "k2"}).status_code == 200
        assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer k1x"}).status_code == 401
        for key in ("k1", "k2"):
            good = openai.OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0)
            assert good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage


def test_metrics_require_key_keeps_metrics_behind_the_key():
    app = create_app(ServeConfig(model_path=str(DEMO / "model"), served_model_name=MODEL,
                                 api_keys=("k1",), metrics_require_key=True))
    with LiveServer(app) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(f"{s.url}/metrics", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for headers in ({"Authorization": "Bearer k1"}, {"x-api-key": "k1"}):
            r = httpx.get(f"{s.url}/metrics", headers=headers)
            assert r.status_code == 200 and 'status="401"' in r.text   # the refusals above, counted
        assert httpx.get(f"{s.url}/health").status_code == 200


def test_a_draining_server_refuses_new_requests_and_ends_the_rest_at_its_deadline():
    """Engine.drain (serve's SIGTERM): new requests get 503 server_shutting_down at once; one in
    flight past the deadline ends with that error in its own API's shape (Messages: an error event)."""
    cfg = ServeConfig(model_path=str(DEMO / "model"), served_model_name="demo", max_batch=2, max_context=4096)
    with LiveServer(create_app(cfg)) as s:
        engine = s.app.state.server.engine
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/messages", json={k: v for k, v in body.items() if k != "ignore_eos"},
                          timeout=60) as first, \
                httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            engine.drain(0.3)
            late = httpx.post(f"{s.url}/v1/completions", json={"model": "demo", "prompt": "hi"}, timeout=60)
            assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
            rest = [ln for ln in lines if ln]
            msgs = [ln for ln in first.iter_lines() if ln]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "server_shutting_down", rest[-3:]
        assert "event: error" in msgs and "shutting down" in msgs[msgs.index("event: error") + 1], msgs[-4:]


def test_ttft_and_request_duration_count_from_when_the_request_reached_the_server(server):
    """The latency histograms start at ``received`` (the handler's first line), not at the engine's
    queue: body parsing, the chat template and tokenizing are part of what a client waits for."""
    import asyncio
    import re
    import time

    from exl3tools.server.sampling_params import SamplingParams

    def ttft_sum() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(re.search(r"^exl3tools_time_to_first_token_seconds_sum\S* (\S+)$", text, re.M).group(1))

    engine = server.app.state.server.engine

    async def one() -> None:   # a request that reached the server 3 s before it was queued
        h = engine.submit(asyncio.get_running_loop(), [[1, 2, 3]], SamplingParams(max_tokens=2), 1,
                          received=time.monotonic() - 3.0)
        async for _ in h.events():
            pass

    before = ttft_sum()
    asyncio.run(one())
    assert 3.0 <= ttft_sum() - before < 60.0


def test_ttft_is_taken_once_the_token_is_on_the_host(server, monkeypatch):
    """The first token's time is taken after the step's one host sync (reading the sampled
    tokens), not before it: on a GPU the step may still be running then (a long prompt's last
    chunk, tens of ms), and the TTFT histogram would report less than a client waits. Here the
    read of the device tokens takes 0.4 s, as a GPU still busy with the step would."""
    import asyncio
    import re
    import time

    from exl3tools.server.sampling_params import SamplingParams

    def ttft_sum() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(re.search(r"^exl3tools_time_to_first_token_seconds_sum\S* (\S+)$", text, re.M).group(1))

    class SlowRead:                 # the sampled tokens, their read waiting on the "device"
        def __init__(self, tokens):
            self.tokens = tokens

        def tolist(self):
            time.sleep(0.4)
            return self.tokens.tolist()

        def rows(self, keep):
            return self.tokens.rows(keep)

    engine = server.app.state.server.engine
    real = engine._sample_device_fn
    if real is None:
        pytest.skip("this engine samples on the host")
    monkeypatch.setattr(engine, "_sample_device_fn", lambda *a: SlowRead(real(*a)))

    async def one() -> None:
        h = engine.submit(asyncio.get_running_loop(), [[1, 2, 3]], SamplingParams(max_tokens=1), 1)
        async for _ in h.events():
            pass

    before = ttft_sum()
    asyncio.run(one())
    assert 0.4 <= ttft_sum() - before < 30.0
