"""bench/gpu_serve.py on the CPU: the real server end to end on synth_checkpoint.py --small (tiny
settings), its stream arithmetic (serve_measure.py), and its exllamav3 side (serve_exllamav3.py)
driven by a stand-in Generator (exllamav3 itself needs CUDA; the H200 run is the real check)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_e2e_model  # noqa: E402
import gpu_serve as gs  # noqa: E402
import serve_exllamav3 as sx  # noqa: E402
import serve_measure as sm  # noqa: E402
import synth_checkpoint as sc  # noqa: E402

TINY = ["--tokens", "8", "--streams", "2", "--prompt-len", "64", "--ttft-prompts", "2", "--ctx", "128",
        "--ctx-streams", "1,2", "--repeats", "1", "--seeded", "3"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "small"
    assert sc.main([str(out), "--small"]) == 0
    return out


def _check_summary(summary: dict, streams=(2,), ctx_streams=(1, 2), ours=True) -> None:
    want = {"single_tok_s", "single_ttft_ms", "ttft_cold_ms", "ttft_hit_ms", "mem_gb"}
    want |= {"ttft_server_cold_ms", "ready_s"} if ours else set()   # our server's /metrics, its start-up
    want |= {f"streams_{n}_tok_s" for n in streams} | {f"ctx_{n}_tok_s" for n in ctx_streams}
    assert want <= set(summary), want - set(summary)
    for k, v in summary.items():
        if k == "seeded":       # same tokens alone and among N streams: "yes" or "no (token i)"
            assert v == "yes" or v.startswith("no (token "), v
            continue
        assert v is not None and v > 0, (k, v)


@pytest.mark.slow
def test_end_to_end_cpu(small, tmp_path):
    """The default config (--max-context 32768) on the CPU: every column measured, the tables last."""
    js = tmp_path / "r.json"
    t = time.perf_counter()
    # the 2-stream bursts over two client processes (--client-procs; a GPU run spreads 8+ streams)
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_serve.py"), str(small), "--device", "cpu", *TINY,
                        "--client-procs", "2", "--client-min-streams", "2",
                        "--json", str(js), "--out", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    took = time.perf_counter() - t
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(js.read_text())
    (cfg,) = r["configs"]
    assert cfg["name"] == "ml32k" and cfg["args"] == ["--max-context", "32768"] and "error" not in cfg
    _check_summary(cfg["summary"])
    res = cfg["results"]
    assert [x["tokens"] for x in res["single"]["runs"]] == [8]
    assert res["streams"]["2"]["tokens"] == 16 and res["ctx"]["2"]["tokens"] == 16
    # each stream's request left its own process's client: both streams' ids and timings came back
    assert all(len(x["per_stream"]) == 2 and all(ps["tokens"] == 8 for ps in x["per_stream"])
               for x in (res["streams"]["2"], res["ctx"]["2"]))
    # the server's steady pace from its step trace, beside the client's figures
    st = res["streams"]["2"]["server_steady"]
    assert set(st) == {"steps", "paths", "step_ms_median", "interval_ms_median"}
    # a step held both streams whenever one still decoded after the other's first token (on a busy
    # CPU the first stream can finish its 8 tokens before the second's prompt is in: no such step);
    # the margin covers the two client processes' send times
    per = res["streams"]["2"]["per_stream"]
    if max(ps["ttft_ms"] for ps in per) + 50 < min(ps["total_ms"] for ps in per):
        assert st["steps"] >= 1, (st, per)
    # the openai client's own time before its request leaves (httpx's hook): part of every TTFT
    c = res["ttft"]["client_ms"]
    assert 0 < c < res["ttft"]["cold_ms"] and "of which the openai client building the request" in p.stdout
    # the server's own TTFT from its /metrics histogram, around the phase: no client time in it
    t = res["ttft"]
    assert 0 < t["server_cold_ms"] < t["cold_ms"] and 0 < t["server_hit_ms"] < t["hit_ms"], t
    assert cfg["summary"]["ttft_server_cold_ms"] == t["server_cold_ms"] and "the server's own (queued" in p.stdout
    assert res["memory"]["source"] == "peak RSS (VmHWM)"
    assert any("kv_cache" in ln for ln in res["metrics"])
    assert cfg["stop_status"] is not None                       # it was stopped, not left running
    seeded = res["seeded"]                  # one sampled request alone, then among 3, 8 tokens each
    assert seeded["streams"] == 3 and seeded["tokens"] == 8 and "[ml32k] seeded: " in p.stdout
    # a differing seeded text is explained as expected outside --batch-invariant, not left to look like a failure
    assert seeded["same"] or "ml32k: a seeded text that differs among streams is expected without" in p.stdout
    # the burst's schedule from /v1/engine/steps: the steps that admitted the two streams, then one more
    burst = res["bursts"]["streams_2"]
    assert sum(len(s["admitted"]) for s in burst) == 2 and not burst[-1]["admitted"]
    assert all(0 <= rcv <= q <= s["at_ms"] for s in burst for rcv, q in s["admitted"])
    assert "[ml32k]  streams_2 burst: " in p.stdout
    assert r["exllamav3"] == {"skipped": "device cpu is not CUDA"}
    out = p.stdout.rstrip().splitlines()
    assert "exllamav3: not available, skipped (device cpu is not CUDA)" in p.stdout
    head = ("| config | 1 stream tok/s | 2 streams | 1 stream @ctx128 | 2 streams @ctx128 | TTFT 64 cold ms "
            "| TTFT 64 prefix-hit ms | its server's own cold ms | RSS GB | ready after s | seeded text alone = among 3 |")
    assert [" ".join(ln.split()) for ln in out if ln.startswith("| config")] == [head, head]
    assert out[-1].startswith("| ml32k ") and out[-7].startswith("| exllamav3 ")   # results, then ratios, last
    print(f"gpu_serve end to end: {took:.1f} s")


def test_group_stats_windows():
    """Aggregate = all tokens over first send -> last token; decode at N streams = tokens while every
    stream is past its first token and none has finished, over that window."""
    a = sm.Stream(0.0, [(1.0, 1)] + [(1.0 + 0.1 * i, 1) for i in range(1, 20)])   # decodes 1.0 .. 2.9
    b = sm.Stream(0.0, [(2.0, 1)] + [(2.0 + 0.1 * i, 1) for i in range(1, 20)])   # decodes 2.0 .. 3.9
    g = sm.group_stats([a, b])
    assert g["tok_s"] == pytest.approx(40 / 3.9)
    assert g["steady_window_s"] == pytest.approx(0.9)
    assert g["decode_method"] == "steady window"
    assert g["decode_tok_s"] == pytest.approx(18 / 0.9)        # 9 tokens each in (2.0, 2.9]
    assert g["per_stream_decode_tok_s_median"] == pytest.approx(19 / 1.9)
    assert g["ttft_ms_median"] == pytest.approx(1500)
    c = sm.Stream(0.0, [(3.5, 1), (3.6, 1)])                  # starts after a finished: no common window
    g = sm.group_stats([a, c])
    assert g["decode_method"] == "after first tokens"
    assert g["decode_tok_s"] == pytest.approx(20 / 2.6)
    one = sm.group_stats([a])
    assert one["decode_tok_s"] == pytest.approx(sm.stream_stats(a)["decode_tok_s"]) == pytest.approx(10)


def test_parse_config_and_cache_size(small):
    assert gs.parse_config("ml128k:--max-context 131072 --api-key 'k 1'") == (
        "ml128k", ["--max-context", "131072", "--api-key", "k 1"])
    assert gs.api_key_of(["--max-context", "8", "--api-key", "k 1"]) == "k 1"
    name, args = gs.parse_config("pv:EXL3TOOLS_FUSED=1 EXL3TOOLS_ROW_STEPS=1 --max-context 8")
    assert gs.config_env(args) == ({"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_ROW_STEPS": "1"}, ["--max-context", "8"])
    assert gs.config_env(["--max-context", "8", "EXL3TOOLS_FUSED=1"])[0] == {}   # only leading words
    for bad in ("noname", ":--max-context 8", "x:--port 9", "x:--host=0.0.0.0", "x:--device cuda:1"):
        with pytest.raises(Exception):  # noqa: B017 - argparse.ArgumentTypeError
            gs.parse_config(bad)
    a = gs.parse_args([str(small)])
    assert a.configs == [("ml32k", ["--max-context", "32768"])] and a.streams == [8, 32]
    assert sx.exllamav3_cache_tokens(a) == 32 * (4096 + 128) == 135168     # a whole number of pages
    a = gs.parse_args([str(small), *TINY])
    assert sx.exllamav3_cache_tokens(a) == 512 and a.vocab == 2048
    with pytest.raises(SystemExit):
        gs.parse_args([str(small), "--config", "a:", "--config", "a:--max-batch 4"])
    # several --ctx values: one phase each, keyed N@CTX, one column each, the longest sizes the cache
    import serve_report

    a = gs.parse_args([str(small), *TINY[:-6], "--ctx", "128,192", "--ctx-streams", "1,2", "--repeats", "1"])
    assert serve_report.ctx_cases(a) == [("1@128", 1, 128), ("2@128", 2, 128), ("1@192", 1, 192), ("2@192", 2, 192)]
    assert [h for k, h in serve_report.columns(a) if k.startswith("ctx_")] == [
        "1 stream @ctx128", "2 streams @ctx128", "1 stream @ctx192", "2 streams @ctx192"]
    assert sx.exllamav3_cache_tokens(a) >= 2 * (192 + 8)
    assert serve_report.summarize({"ctx": {"2@192": {"decode_tok_s": 5.0}}}) == {"ctx_2@192_tok_s": 5.0}


def test_join_phase_end_to_end_cpu(small, tmp_path):
    """--join N:CTX:M on the real CPU server: the M short prompts go out once the N running streams
    have JOIN_AFTER_TOKENS tokens each; their TTFT and the running streams' longest gap while they
    are admitted are measured and tabled. With --text-prompts: every prompt sent as text, which the
    server tokenizes (its prompt-token counter then differs from the ids' count)."""
    js = tmp_path / "r.json"
    args = ["--tokens", "24", "--streams", "2", "--prompt-len", "64", "--ttft-prompts", "1", "--ctx", "96",
            "--ctx-streams", "1", "--repeats", "1", "--join", "2:96:2", "--no-warmup", "--seeded", "0", "--text-prompts"]
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_serve.py"), str(small), "--device", "cpu", *args,
                        "--json", str(js), "--out", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (cfg,) = json.loads(js.read_text())["configs"]
    j = cfg["results"]["join"]
    assert (j["base"], j["joiners"], j["ctx"], j["tokens"]) == (2, 2, 96, sm.JOIN_MIN_TOKENS)
    # (both base streams run 64 tokens and the joiners go out at 8, but a loaded CI machine can
    # hold the client back until one has finished: make test of the 2026-12-06 14:28 session)
    assert "join" in cfg["results"]["phases"] and j["running_at_join"] in (1, 2), j
    assert 0 < j["joiner_ttft_ms_median"] <= j["joiner_ttft_ms_max"] and j["window_ms"] > 0, j
    assert j["stall_ms_max"] >= j["stall_ms_median"] > 0 and j["itl_ms_median_before"] > 0, j
    assert cfg["summary"]["join_stall_ms"] == j["stall_ms_max"]
    # the prompts went as text: the server's prefix lookups counted its own tokenization, not the
    # ids (sent as ids, this run counts exactly these 576: single, streams, ttft x2, ctx, join)
    ids_sent = 32 + 2 * 32 + 2 * 64 + 96 + 2 * 96 + 2 * 32
    queried = cfg["results"]["engine_stats_end"]["prefix_cache_queried_tokens"]
    assert queried > 0 and queried != ids_sent, queried
    assert "stall ms, 2 join 2 @ctx96" in p.stdout and "join: 2 new 32-token prompts beside 2 streams" in p.stdout
    with pytest.raises(SystemExit):
        gs.parse_args([str(small), "--join", "2:96"])


def test_join_stats_windows():
    """The stall is each running stream's longest gap overlapping the join window (first new request
    sent -> last new first token); the gaps before the window give the usual inter-token time."""
    base = [sm.Stream(0.0, [(0.1 * i, 1) for i in range(1, 11)]), sm.Stream(0.0, [(0.1 * i, 1) for i in (1, 2, 3, 4, 9, 10)])]
    new = [sm.Stream(0.45, [(0.85, 1), (0.95, 1)]), sm.Stream(0.5, [(0.7, 1)])]
    j = sm.join_stats(base, new)
    assert j["stall_ms_max"] == pytest.approx(500) and j["stall_ms_median"] == pytest.approx(300)
    assert j["itl_ms_median_before"] == pytest.approx(100) and j["window_ms"] == pytest.approx(400)
    assert j["joiner_ttft_ms_median"] == pytest.approx(300) and j["joiner_ttft_ms_max"] == pytest.approx(400)
    assert j["running_at_join"] == 2


def test_join_stats_leaves_out_streams_done_before_the_join():
    """A running stream that finished before the first new request went out felt no join: it
    counts in neither the stall nor its median (once it was counted as a 0 ms stall); with none
    left running the stall is None, and the log line says so."""
    done = sm.Stream(0.0, [(0.1 * i, 1) for i in range(1, 5)])            # last token at 0.4
    live = sm.Stream(0.0, [(0.1 * i, 1) for i in (1, 2, 3, 4, 9, 10)])
    new = [sm.Stream(0.45, [(0.85, 1)])]
    j = sm.join_stats([done, live], new)
    assert j["running_at_join"] == 1 and j["stall_ms_max"] == j["stall_ms_median"] == pytest.approx(500)
    assert j["itl_ms_median_before"] == pytest.approx(100)
    j = sm.join_stats([done], new)
    assert j["running_at_join"] == 0 and j["stall_ms_max"] is None and j["stall_ms_median"] is None


def test_exllamav3_side_with_a_stand_in(small, monkeypatch):
    """The exllamav3 path (load, Jobs, iterate, token accounting, memory, summary) with a stand-in
    Generator that streams one token per job per iterate(), some held back and sent two at a time."""
    loaded = {}

    class Job:
        def __init__(self, input_ids, max_new_tokens, sampler, stop_conditions, identifier):
            assert input_ids.shape[0] == 1 and stop_conditions is None and isinstance(sampler, ArgmaxSampler)
            self.n, self.left, self.identifier, self.held = input_ids.shape[1], max_new_tokens, identifier, 0

    class ArgmaxSampler:
        pass

    class Generator:
        def __init__(self, model, cache, tokenizer):
            self.jobs = []

        def enqueue(self, job):
            self.jobs.append(job)
            loaded.setdefault("lens", []).append(job.n)

        def num_remaining_jobs(self):
            return len(self.jobs)

        def iterate(self):
            out = []
            for j in self.jobs:
                j.left -= 1
                j.held += 1
                if j.held == 2 or j.left == 0 or j.left % 3:
                    out.append({"stage": "streaming", "identifier": j.identifier, "eos": j.left == 0,
                                "token_ids": torch.zeros(1, j.held, dtype=torch.long)})
                    j.held = 0
            self.jobs = [j for j in self.jobs if j.left > 0]
            return out

    class Model:
        def unload(self):
            loaded["unloaded"] = True

    def load(ckpt, ntok, n_caches, device):
        loaded.update(ckpt=ckpt, ntok=ntok, device=device)
        return object(), Model(), [object()], object(), 0.01

    monkeypatch.setitem(sys.modules, "exllamav3", types.SimpleNamespace(
        ArgmaxSampler=ArgmaxSampler, Generator=Generator, Job=Job, __version__="stand-in"))
    monkeypatch.setattr(gpu_e2e_model, "load_exllamav3", load)
    monkeypatch.setattr(gpu_e2e_model, "_free", lambda: None)
    for name in ("set_device", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *_a, **_k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *_a: 2e9)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *_a: 3e9)
    a = gs.parse_args([str(small), "--device", "cuda", *TINY])
    report = {"notes": [], "exllamav3": None}
    entry = sx.run_exllamav3_side(a, report, None, lambda: None)
    lens = loaded.pop("lens")
    assert report["exllamav3"] is entry and loaded == {"ckpt": str(small), "ntok": 512, "device": "cuda:0",
                                                       "unloaded": True}
    # the ctx phase's 1 + 2 prompts of 128 tokens, and one in the warm-up before (a first prefill
    # at a new length compiles kernels: it must not land in the timed phase)
    assert lens.count(128) == 4 and lens[:7] == [32] * 4 + [64, 128, 32]   # warm-up, then the single stream
    assert entry["version"] == "stand-in" and entry["results"]["max_memory_allocated_gb"] == 2.0
    _check_summary(entry["summary"], ours=False)
    res = entry["results"]
    assert res["streams"][2]["tokens"] == 16 and [x["tokens"] for x in res["single"]["runs"]] == [8]
    assert set(res["phases"]) == {"warmup", "single", "streams_2", "ttft", "ctx_1", "ctx_2"}
    # the join phase: the new jobs are enqueued once each running one has its tokens
    a = gs.parse_args([str(small), "--device", "cuda", "--tokens", "24", *TINY[2:], "--join", "2:96:3"])
    t = sm.JOIN_MIN_TOKENS                             # the join phase's streams run at least this many
    assert sx.exllamav3_cache_tokens(a) == sm.round_pages(max(2 * (128 + 24), 2 * (96 + t) + 3 * (32 + t)))
    seen = {}
    real = sm.join_stats
    monkeypatch.setattr(sm, "join_stats", lambda base, new: seen.update(base=base, new=new) or real(base, new))
    loaded.clear()
    j = sx.run_exllamav3_side(a, {"notes": [], "exllamav3": None}, None, lambda: None)["results"]["join"]
    assert (j["base"], j["joiners"], j["tokens"]) == (2, 3, t) and j["joiner_ttft_ms_max"] > 0
    assert all(s.tokens == t for s in seen["base"] + seen["new"])
    # 96-token prompts: the warm-up join's stream (its CTX-token prefill), the join phase's two streams
    assert loaded["lens"].count(96) == 3
    sent = min(s.t_send for s in seen["new"])          # after each running job had JOIN_AFTER_TOKENS tokens
    assert all(sum(k for t, k in s.events if t <= sent) >= sm.JOIN_AFTER_TOKENS for s in seen["base"])
    assert any("max_memory_allocated 2.00 GB" in n for n in report["notes"])


def test_memory_split_reads_weights_and_kv_from_engine_stats():
    stats = {"memory": {"weights": 7.45e9, "kv_pool": 124.98e9, "allocated": 1, "reserved": 1, "peak_allocated": 1}}
    assert gs.memory_split(135.79, stats) == " = weights 7.45 + KV 124.98 + beyond 3.36 GB"
    assert gs.memory_split(135.79, {"memory": {"kv_pool": 1e9}}) == "" and gs.memory_split(1.0, None) == ""


def test_budget_notes_count_the_join_phase(small):
    """The join phase's streams (at least JOIN_MIN_TOKENS tokens each) count in the KV budget and
    the longest context that the notes check before the run."""
    a = gs.parse_args([str(small), *TINY[:-6], "--ctx", "128", "--ctx-streams", "1", "--join", "4:256:8"])
    t = max(a.tokens, sm.JOIN_MIN_TOKENS)
    need = 4 * (256 + t) + 8 * (a.short_prompt_len + t)
    notes = gs.budget_notes(a, "ours", {"cache_tokens_budget": need - 1}, 256 + t - 1)
    assert notes == [f"ours: the join, 4 @ctx256 + 8 needs {need} KV tokens > the server's budget {need - 1}: it "
                     "queues or preempts (raise --max-cache-tokens)", f"ours: max_model_len {256 + t - 1} < {256 + t}"]
    assert gs.budget_notes(a, "ours", {"cache_tokens_budget": need}, 256 + t) == []
