"""`exl3tools serve` as users run it: a subprocess, the demo model by default, signals, bad paths."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from tests.conftest import REPO  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "exl3tools.cli", "serve", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})


def wait_healthy(proc: subprocess.Popen, port: int) -> str:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "server not healthy in 120 s"
        time.sleep(0.1)


# (the demo served without a path, its name listed and a completion, then a clean SIGTERM exit:
# test_sigterm_lets_streams_in_flight_finish_within_the_shutdown_timeout's servers; an idle
# server's SIGTERM exit: test_serves_a_hub_repo_id_from_the_cache_offline)


# tokens: the long timeout's stream must only outlive the SIGTERM sent at its 5th event (300 tokens
# drain in ~2.5 s of a busy CPU; 1500 took ~12 s for the same check); the short one's must outlive
# its 0.2 s timeout by far, and it is cut there
@pytest.mark.parametrize("timeout,whole,tokens", [("60", True, 300), ("0.2", False, 1500)])
def test_sigterm_lets_streams_in_flight_finish_within_the_shutdown_timeout(timeout, whole, tokens):
    """SIGTERM mid-stream: with --shutdown-timeout long enough the stream ends whole (every token,
    then usage and [DONE]); with a short one it ends early with a 503 server_shutting_down error
    event and [DONE], not a cut connection or a traceback; the server exits cleanly either way."""
    import json

    port = free_port()
    proc = serve("--port", str(port), "--log-level", "warning", "--shutdown-timeout", timeout)
    events, done = [], False
    try:
        url = wait_healthy(proc, port)        # no path: the demo
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "glm4_moe-3.0bpw-mcg"
        body = {"model": "glm4_moe-3.0bpw-mcg", "prompt": "hi", "max_tokens": tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == 5:
                        proc.send_signal(signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert "Traceback" not in err and done, (err, events[-1:])
    if whole:
        assert events[-1]["usage"]["completion_tokens"] == tokens
    else:
        assert events[-1]["error"]["code"] == "server_shutting_down", events[-1]
        assert "requests in flight ended" in err


@pytest.mark.parametrize("args,code,text", [
    (["/nonexistent/model"], 2, "no such checkpoint directory"),
    ([str(REPO / "demo")], 2, "not a checkpoint"),
    ([str(REPO / "demo" / "glm4_moe-3.0bpw-mcg")], 2, "glm4_moe-3.0bpw-mcg/model has one: give that folder"),
    (["--max-batch", "0"], 2, "must be at least 1"),
    (["--batch-invariant"], 2, "--batch-invariant needs --device cuda"),
])
def test_bad_invocations_fail_in_one_line(args, code, text):
    proc = serve(*args, "--port", str(free_port()), "--log-level", "critical")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert text in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_a_bad_switch_interval_fails_in_one_line(value):
    """EXL3TOOLS_SWITCH_INTERVAL_MS (docs/serve.md "Diagnostics") is checked before anything loads."""
    proc = serve("--port", str(free_port()), "--log-level", "critical", env={"EXL3TOOLS_SWITCH_INTERVAL_MS": value})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "EXL3TOOLS_SWITCH_INTERVAL_MS must be a positive number of ms" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("var", "value"), [("EXL3TOOLS_MLA_TILE", "32,24,8"), ("EXL3TOOLS_MLA_ABSORB_DOT", "tf32")])
def test_a_bad_mla_tile_fails_in_one_line(var, value):
    """EXL3TOOLS_MLA_TILE and EXL3TOOLS_MLA_ABSORB_DOT (docs/serve.md "Diagnostics") are parsed
    before anything loads."""
    proc = serve("--port", str(free_port()), "--log-level", "critical", env={var: value})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert f"{var}={value!r}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_serves_a_hub_repo_id_from_the_cache_offline(tmp_path):
    import os
    import shutil

    cache = tmp_path / "hub"
    repo = cache / "models--exl3tools--demo-exl3"
    snap = repo / "snapshots" / ("a" * 40)
    shutil.copytree(REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model", snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exl3tools.cli", "serve", "exl3tools/demo-exl3", "--port",
                             str(port), "--log-level", "warning"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = wait_healthy(proc, port)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "exl3tools/demo-exl3"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    # an idle server: uvicorn shuts down gracefully, then re-raises the signal it caught (the
    # conventional status)
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert "Traceback" not in err
    missing = subprocess.run([sys.executable, "-m", "exl3tools.cli", "serve", "exl3tools/absent", "--port",
                              str(free_port())], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2, missing.stderr
    assert "exl3tools/absent" in missing.stderr and "Traceback" not in missing.stderr


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def _serve_tp2(model, *extra: str) -> tuple[subprocess.Popen, str, list[int]]:
    """`serve MODEL --tp 2 --moe ep` (and ``extra``) once healthy: (process, url, its worker pids)."""
    port = free_port()
    proc = serve(str(model), "--tp", "2", "--moe", "ep", "--port", str(port), "--log-level", "warning", *extra)
    try:
        return proc, wait_healthy(proc, port), _children(proc.pid)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise


TP_MODEL = REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model"
TP_SEED = "5"


@pytest.fixture(scope="module")
def tp2_server():
    """One `serve --tp 2 --moe ep --seed 5` (a worker rank spawned) for the two tests below: its url.
    Only the sampling test sends requests without a seed (each takes the next of --seed's), so
    its requests get the same seeds whichever tests ran before it. Afterwards SIGTERM must stop
    both processes cleanly, the worker reaped."""
    proc, url, workers = _serve_tp2(TP_MODEL, "--seed", TP_SEED)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err
    assert len(workers) == 1 and not os.path.exists(f"/proc/{workers[0]}/status"), workers   # reaped


def test_tensor_parallel_serving_matches_one_process(tp2_server):
    """--tp 2 (experts cut whole, --moe ep): greedy tokens equal TP=1's."""
    from exl3tools.runtime.runner import load_runner
    from exl3tools.runtime.sampling import sample

    r = httpx.post(f"{tp2_server}/v1/completions", json={"model": "glm4_moe-3.0bpw-mcg", "prompt": [1, 50, 60],
                                                         "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                         "return_token_ids": True, "seed": 0}, timeout=60)
    assert r.status_code == 200, r.text     # (a make test run under load once got a reply without choices)
    served = r.json()["choices"][0]["token_ids"]
    with load_runner(str(TP_MODEL)) as runner:
        runner.add_sequence(0)
        toks, new = [], [1, 50, 60]
        for _ in range(6):
            toks.append(sample(runner.step([(0, new)])[0], 0.0))
            new = [toks[-1]]
    assert served == toks


def _sampled_texts(url: str) -> list[str]:
    """Through the official client: two unseeded sampled completions (their seeds the next two of
    the server's --seed), then one request with its own seed, twice."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    req = dict(model="glm4_moe-3.0bpw-mcg", prompt="Once", max_tokens=8, temperature=1.0,
               extra_body={"ignore_eos": True})
    unseeded = [client.completions.create(**req).choices[0].text for _ in range(2)]
    return unseeded + [client.completions.create(**req, seed=7).choices[0].text for _ in range(2)]


def test_tensor_parallel_serving_samples_as_one_process_with_the_same_seed(tp2_server):
    """--seed at --tp 2 (rank 0 samples from the logits the ranks combine): the same sampled texts
    as a one-process server started with the same --seed, request for request."""
    from exl3tools.server.app import ServeConfig, create_app
    from exl3tools.server.testing import LiveServer

    served = _sampled_texts(tp2_server)
    # the one-process server in this process (what `serve MODEL --seed 5` builds; a subprocess of it
    # cost a fresh interpreter's imports): the CLI's own --seed handling is the TP 2 server's
    one = create_app(ServeConfig(model_path=str(TP_MODEL), served_model_name="glm4_moe-3.0bpw-mcg",
                                 seed=int(TP_SEED)))
    with LiveServer(one) as s:
        alone = _sampled_texts(s.url)
    assert served[0] != served[1]      # each unseeded request the next of --seed's seeds ...
    assert served[2] == served[3]      # a request's own seed: the same text every time
    assert served == alone, (served, alone)


def test_tensor_parallel_serving_stops_when_a_rank_dies():
    """A --tp 2 server whose worker is killed while it idles: `serve` exits 4 on its own within
    seconds, with one line naming the lost rank (it used to stay healthy until a request came,
    and before that fail every request with a 500), so a supervisor restarts it."""
    proc, url, workers = _serve_tp2(TP_MODEL)
    try:
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)     # no request: the watch on the ranks sees it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 4, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: runtime failure") and "tensor-parallel peer lost: rank 1 (pid " in last, err
    assert "exited with signal 9" in last and "Traceback" not in err, err
