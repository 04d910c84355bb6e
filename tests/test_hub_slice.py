"""rank-slice straight from a Hub repo, against a real HTTP server on 127.0.0.1 (tests/hub_server.py).

huggingface_hub is pointed at the server (HF_ENDPOINT, HF_HOME in tmp_path, HF_HUB_OFFLINE unset);
nothing leaves the loopback. Outputs are compared byte for byte with the local rank-slice of the
same checkpoint; the server counts every byte it sends.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from exl3tools.cli import main

from exl3tools import hub_slice as H
from exl3tools.checkpoint import Checkpoint
from exl3tools.slicing import plan_rank_slices, write_rank_shards
from tests.conftest import REPO, fixture_dir
from tests.hub_server import COMMIT_A, COMMIT_B, FakeHub, hub_settings

DEMO = REPO / "demo" / "glm4_moe-3.0bpw-mcg" / "model"
REPO_ID = "org/model-exl3"


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """Point huggingface_hub (already imported, so its constants too) at a server started later."""
    from huggingface_hub import constants

    def point(url: str) -> None:
        env, consts = hub_settings(url, tmp_path / "hf")
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        for k in ("HF_HUB_OFFLINE", "HF_TOKEN"):
            monkeypatch.delenv(k, raising=False)
        for k, v in consts.items():
            monkeypatch.setattr(constants, k, v)

    return point


def _local(src: Path, tmp_path: Path, tp: int, moe: str) -> Path:
    out = tmp_path / f"local-{tp}-{moe}"
    ck = Checkpoint.open(src)
    write_rank_shards(ck, plan_rank_slices(ck, tp, moe), out)
    return out


def _same_rank_dirs(a: Path, b: Path, dirs: list[str]) -> None:
    for d in dirs:
        names = sorted(p.name for p in (a / d).iterdir())
        assert names == sorted(p.name for p in (b / d).iterdir())
        for n in names:
            assert filecmp.cmp(a / d / n, b / d / n, shallow=False), f"{d}/{n} differs"


def _data_bytes(hub: FakeHub, ck: Checkpoint) -> int:
    """Bytes the server sent from the tensor data (not the headers) of safetensors files."""
    return sum(g.sent for g in hub.state.gets if g.file.endswith(".safetensors")
               and g.start >= ck.headers[g.file].data_start)


@pytest.mark.parametrize("tp,moe", [(2, "tp"), (4, "tp"), (2, "ep"), (4, "ep")])
def test_output_identical_to_local_slice(tmp_path, hub_env, tp, moe):
    src = fixture_dir("glm4_moe-tp-2.0bpw-mul1") / "model"
    local = _local(src, tmp_path, tp, moe)
    with FakeHub(src, REPO_ID) as hub:
        hub_env(hub.url)
        ck, rs, plan = H.remote_plan(REPO_ID, tp, moe)
        assert rs.commit == COMMIT_A and plan.source.repo == REPO_ID
        gap = 4096  # fewer requests keep the test fast; the byte count below is checked at gap 4096
        man = H.rank_slice_remote(ck, rs, plan, tmp_path / "out", list(range(tp)), gap=gap)
        want = H.fetch_summary(plan, ck, list(range(tp)), gap)["fetch_bytes"]
        assert _data_bytes(hub, ck) == want
        assert not any(not g.ranged for g in hub.state.gets if g.file.endswith(".safetensors"))
    _same_rank_dirs(tmp_path / "out", local, list(plan.dirs))
    assert man.source.repo == REPO_ID and man.source.revision == COMMIT_A
    assert not rs.mirror.exists()  # the range mirror is dropped after a successful slice


@pytest.mark.parametrize("src_name,tp,moe,rank", [("demo", 2, "ep", 0), ("demo", 4, "ep", 3),
                                                   ("glm4_moe-tp-2.0bpw-mul1", 2, "tp", 1)])
def test_bytes_per_rank_equal_the_plan(tmp_path, hub_env, src_name, tp, moe, rank):
    """--ranks R at --merge-gap 0: the server sends exactly the rank's tensor bytes, no whole files."""
    src = DEMO if src_name == "demo" else fixture_dir(src_name) / "model"
    with FakeHub(src, REPO_ID) as hub:
        hub_env(hub.url)
        ck, rs, plan = H.remote_plan(REPO_ID, tp, moe)
        H.rank_slice_remote(ck, rs, plan, tmp_path / "out", [rank], parallel=8)
        # one connection per worker thread, kept alive over its ranges (a column cut: ~2700 GETs);
        # a response left unread used to close its connection: one TCP (TLS) handshake per range
        ranged = sum(g.ranged for g in hub.state.gets)
        assert hub.state.connections <= 8 + 4 < ranged, (hub.state.connections, ranged)
        tensor_bytes = sum(t.nbytes for sp in plan.shards for t in sp.outputs[rank])
        assert _data_bytes(hub, ck) == tensor_bytes
        assert H.fetch_summary(plan, ck, [rank])["fetch_bytes"] == tensor_bytes
        size = sum(h.file_size for h in ck.headers.values())
        assert tensor_bytes < size
        assert all(g.ranged for g in hub.state.gets if g.file.endswith(".safetensors"))
    local = _local(src, tmp_path, tp, moe)
    _same_rank_dirs(tmp_path / "out", local, [plan.dirs[rank]])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json", plan.dirs[rank]]


def test_dropped_connection_resumes_at_the_next_byte(tmp_path, hub_env):
    with FakeHub(DEMO, REPO_ID) as hub:
        hub_env(hub.url)
        ck, rs, plan = H.remote_plan(REPO_ID, 2, "ep")
        hub.state.drop_once = {"model.safetensors": 5000}  # the next GET ends after 5000 bytes, once
        H.rank_slice_remote(ck, rs, plan, tmp_path / "out", [0], parallel=1)
        gets = [g for g in hub.state.gets if g.start >= ck.headers["model.safetensors"].data_start]
        cut = [g for g in gets if g.sent < g.end - g.start]
        assert len(cut) == 1 and cut[0].sent == 5000
        assert any(g.start == cut[0].start + 5000 and g.end == cut[0].end for g in gets)  # resumed, not restarted
        assert _data_bytes(hub, ck) == sum(t.nbytes for sp in plan.shards for t in sp.outputs[0])
    _same_rank_dirs(tmp_path / "out", _local(DEMO, tmp_path, 2, "ep"), [plan.dirs[0]])


def test_changed_revision_is_refused(tmp_path, hub_env):
    with FakeHub(DEMO, REPO_ID) as hub:
        hub_env(hub.url)
        ck, rs, plan = H.remote_plan(REPO_ID, 2, "ep")
        hub.state.commit = COMMIT_B  # main moves between plan and fetch
        with pytest.raises(H.RevisionChangedError, match="moved from aaaaaaaaaaaa to bbbbbbbbbbbb"):
            H.rank_slice_remote(ck, rs, plan, tmp_path / "out", [0])
    assert not (tmp_path / "out" / "manifest.json").exists()


def _cli(hub: FakeHub, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The installed CLI in a fresh process: HF_ENDPOINT / HF_HOME are read from the environment."""
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), EXL3TOOLS_DEBUG="")
    for k in ("HF_HUB_OFFLINE", "HF_TOKEN"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "exl3tools.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_cli_changed_revision_mid_fetch_exit_1_one_line(tmp_path):
    with FakeHub(DEMO, REPO_ID) as hub:
        hub.state.flip_commit_after = 2  # the 8-byte length and the header at planning, then main moves
        r = _cli(hub, tmp_path, "rank-slice", REPO_ID, str(tmp_path / "out"), "--tp", "2", "--moe", "ep")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: revision changed: hf://org/model-exl3: revision main moved from "
                                "aaaaaaaaaaaa to bbbbbbbbbbbb"), r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_cli_dry_run_slice_and_verify_against_the_repo(tmp_path, hub_env):
    with FakeHub(DEMO, REPO_ID) as hub:
        hub_env(hub.url)
        run = CliRunner().invoke
        res = run(main, ["rank-slice", REPO_ID, str(tmp_path / "out"), "--tp", "2", "--moe", "ep", "--ranks", "1",
                         "--dry-run", "--json"])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.output)
        assert doc["revision"] == COMMIT_A and [r["rank"] for r in doc["fetch"]["ranks"]] == [1]
        assert doc["fetch"]["ranks"][0]["bytes"] == doc["outputs"][1]["bytes"]
        header = Checkpoint.open(DEMO).headers["model.safetensors"].data_start
        assert not (tmp_path / "out").exists() and hub.state.fetched("model.safetensors") == header  # headers only
        res = run(main, ["rank-slice", f"{REPO_ID}@main", str(tmp_path / "out"), "--tp", "2", "--moe", "ep",
                         "--ranks", "1"])
        assert res.exit_code == 0, res.output
        man = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert man["source"]["repo"] == REPO_ID and man["source"]["revision"] == COMMIT_A
        assert [r["rank"] for r in man["ranks"]] == [1]
        res = run(main, ["verify", REPO_ID, str(tmp_path / "out")])
        assert res.exit_code == 0, res.output
        t = next((tmp_path / "out" / "rank-1-of-2").glob("*.safetensors"))
        data = bytearray(t.read_bytes())
        data[-1] ^= 1
        t.chmod(0o644)
        t.write_bytes(bytes(data))
        res = run(main, ["verify", REPO_ID, str(tmp_path / "out"), "--no-hash"])
        assert res.exit_code == 1 and "differs" in res.output
        for args, msg in [(["org/absent", "--tp", "2"], "no such Hugging Face repository"),
                          ([REPO_ID, "--tp", "2", "--ranks", "2"], "ranks must be in 0..1"),
                          ([REPO_ID, "--tp", "2", "--layout", "vllm-hybrid"], "needs a local SRC")]:
            res = run(main, ["rank-slice", args[0], str(tmp_path / "o2"), *args[1:]])
            assert res.exit_code == 2 and msg in res.output, res.output
            assert len(res.output.strip().splitlines()) == 1


def test_serve_path_for_tp_slices_into_the_cache_then_reuses_it(tmp_path, hub_env):
    """serve REPO --tp 2 loads from a rank-slice output in the cache, fetched by ranges; a rank lost
    from an interrupted run is fetched again (its ranges only), a complete one costs headers only."""
    from exl3tools.runtime.loader import resolve
    from exl3tools.server.app import local_path

    with FakeHub(DEMO, REPO_ID) as hub:
        hub_env(hub.url)
        path = Path(local_path(REPO_ID, 2, "ep"))
        assert path.is_relative_to(tmp_path / "hf") and resolve(path, 2).kind == "ranks"
        ck = Checkpoint.open(DEMO)
        plan = plan_rank_slices(ck, 2, "ep")
        assert _data_bytes(hub, ck) == H.fetch_summary(plan, ck, [0, 1])["fetch_bytes"]
        _same_rank_dirs(path, _local(DEMO, tmp_path, 2, "ep"), list(plan.dirs))
        hub.state.gets.clear()
        assert Path(local_path(f"{REPO_ID}@main", 2, "ep")) == path and _data_bytes(hub, ck) == 0
        # an interrupted run: rank 1's shard never finished, the journal records the rest
        (path / "manifest.json").unlink()
        (path / "rank-1-of-2" / "model-00001-of-00001.safetensors").unlink()
        journal = [json.dumps({"path": f, "size": v["size"], "sha256": v["sha256"], "plan": plan.fingerprint})
                   for f, v in json.loads((tmp_path / "local-2-ep" / "manifest.json").read_text())["files"].items()
                   if f.startswith("rank-0-of-2/")]
        (path / ".rank-slice.journal").write_text("\n".join(journal) + "\n")
        local_path(REPO_ID, 2, "ep")
        assert _data_bytes(hub, ck) == H.fetch_summary(plan, ck, [1])["fetch_bytes"]
    _same_rank_dirs(path, tmp_path / "local-2-ep", list(plan.dirs))


def test_generate_repo_with_tp_loads_the_cached_slices(tmp_path, hub_env, monkeypatch):
    from exl3tools.runtime import runner

    seen = []
    monkeypatch.setattr(runner, "load_runner", lambda path, **kw: seen.append((Path(path), kw["tp"])))  # a worker: None
    with FakeHub(DEMO, REPO_ID) as hub:
        hub_env(hub.url)
        res = CliRunner().invoke(main, ["generate", REPO_ID, "--tp", "2", "--moe", "ep", "--token-ids", "1,2"])
    assert res.exit_code == 0, res.output
    (path, tp), = seen
    assert tp == 2 and path.name == "tp2-ep" and path.is_relative_to(tmp_path / "hf")
    assert (path / "manifest.json").is_file()


def test_hostile_index_shard_name_refused(tmp_path, hub_env):
    """The index comes from the server; a shard named ../x would be written outside the mirror."""
    repo_dir = tmp_path / "repo"
    repo_dir.mkdir()
    for p in DEMO.iterdir():
        (repo_dir / p.name).write_bytes(p.read_bytes())
    (repo_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../evil.safetensors"}}))
    with FakeHub(repo_dir, REPO_ID) as hub:
        hub_env(hub.url)
        res = CliRunner().invoke(main, ["rank-slice", REPO_ID, str(tmp_path / "out"), "--tp", "2", "--moe", "ep"])
    assert res.exit_code == 1 and "shard name '../evil.safetensors'" in res.output, res.output
    assert not list((tmp_path / "hf").rglob("evil*")) and not (tmp_path / "out").exists()


def test_connection_that_never_delivers_gives_up_exit_2(tmp_path, hub_env, monkeypatch):
    monkeypatch.setattr(H.time, "sleep", lambda s: None)  # no backoff waits in the test
    with FakeHub(DEMO, REPO_ID) as hub:
        hub_env(hub.url)
        ck, rs, plan = H.remote_plan(REPO_ID, 2, "ep")
        hub.state.drop_once, hub.state.drop_times = {"model.safetensors": 0}, 10**6
        res = CliRunner().invoke(main, ["rank-slice", REPO_ID, str(tmp_path / "out"), "--tp", "2", "--moe", "ep",
                                        "--parallel", "1"])
    assert res.exit_code == 2, res.output
    assert f"failed {H.RETRIES + 1} times in a row" in res.output and "download failed: hf://" in res.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_subtract_is_the_set_difference():
    """hub_slice.subtract (what the mirror still lacks) against byte sets, on random ranges: one
    sweep, so a 10^6-range column cut no longer rescans the completed ranges per range."""
    import random

    rnd = random.Random(7)
    for _ in range(300):
        ranges = [(a, a + rnd.randint(0, 40)) for a in (rnd.randint(0, 200) for _ in range(rnd.randint(0, 12)))]
        done = H.merge([(a, a + rnd.randint(1, 30)) for a in (rnd.randint(0, 200) for _ in range(rnd.randint(0, 12)))])
        got = H.subtract(ranges, done)
        covered = {x for a, b in done for x in range(a, b)}
        want = sorted({x for a, b in ranges for x in range(a, b)} - covered)
        assert sorted({x for a, b in got for x in range(a, b)}) == want
        assert all(a < b for a, b in got)
    n = 200_000   # ranges: linear (the old per-range rescan: ~11 min here, hours at 10^6)
    ranges = [(i * 10, i * 10 + 4) for i in range(n)]
    assert H.subtract(ranges, [(i * 10, i * 10 + 2) for i in range(0, n, 2)])[:2] == [(2, 4), (10, 14)]


def test_an_answer_longer_than_the_range_is_refused(tmp_path, hub_env, monkeypatch):
    """Hostile: a 206 with the right Content-Range but a longer Content-Length (its body starts with
    bytes that are not the range) is a one-line TransferError naming the file; no range of it is
    recorded complete, so a rerun against an honest server fetches everything again."""
    from exl3tools.errors import TransferError

    monkeypatch.setattr(H.time, "sleep", lambda s: None)  # no backoff waits in the test (~3 s idle)
    with FakeHub(DEMO, REPO_ID) as hub:
        hub_env(hub.url)
        ck, rs, plan = H.remote_plan(REPO_ID, 2, "ep")
        hub.state.overrun = 100
        # retried like any bad answer (a CDN hiccup), then refused with the reason
        with pytest.raises(TransferError, match=r"model\.safetensors: bytes \d+-\d+ failed 6 times .*asked for \d+ bytes"):
            H.rank_slice_remote(ck, rs, plan, tmp_path / "out", [0], parallel=1)
        log = rs.mirror / ".model.safetensors.ranges"   # the header, read while planning, only
        data_start = ck.headers["model.safetensors"].data_start
        assert all(json.loads(x)["b"] <= data_start for x in log.read_text().splitlines())
        hub.state.overrun = 0
        H.rank_slice_remote(ck, rs, plan, tmp_path / "out2", [0], parallel=1)
    _same_rank_dirs(tmp_path / "out2", _local(DEMO, tmp_path, 2, "ep"), [plan.dirs[0]])
