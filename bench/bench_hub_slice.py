"""rank-slice from a Hub repo, one node per rank, vs downloading the whole repo (snapshot_download).

Serves a checkpoint directory as a Hugging Face repo from a real HTTP server on 127.0.0.1
(tests/hub_server.py; nothing leaves the loopback) and, each from an empty HF_HOME:
  - per rank r: `rank-slice REPO OUT --tp N --ranks r` (plan from the remote headers, fetch only
    rank r's byte ranges, write rank r's shards), timed, with the bytes the server sent;
  - snapshot_download of the whole repo (what each node does today before slicing), timed, with the
    bytes the server sent.
Prints the ratios side by side. The loopback has no latency or bandwidth limit, so the time ratios
show the per-request overhead; on a real link the byte ratio is what a node saves.

    .venv/bin/python bench/bench_hub_slice.py [--src DIR] [--tp 4] [--moe tp] [--merge-gap 0]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.hub_server import FakeHub, hub_settings  # noqa: E402

REPO_ID = "bench/model-exl3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=REPO.parent / "shared" / "fixtures" / "glm4_moe-tp-2.0bpw-mul1" / "model")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--moe", choices=["tp", "ep"], default="tp")
    ap.add_argument("--merge-gap", type=int, default=0)
    ap.add_argument("--parallel", type=int, default=8)
    a = ap.parse_args()
    os.environ.pop("HF_HUB_OFFLINE", None)
    os.environ.pop("HF_TOKEN", None)
    from huggingface_hub import constants, snapshot_download

    from exl3tools import hub_slice as H

    scratch = Path(tempfile.mkdtemp(prefix="bench-hub-"))
    rows = []
    try:
        with FakeHub(a.src, REPO_ID) as hub:
            def fresh(name: str) -> None:
                env, consts = hub_settings(hub.url, scratch / name / "hf")
                os.environ.update(env)
                for k, v in consts.items():
                    setattr(constants, k, v)
                hub.state.gets.clear()

            fresh("whole")
            t = time.perf_counter()
            snapshot_download(REPO_ID)
            whole_s, whole_b = time.perf_counter() - t, hub.state.fetched()
            for r in range(a.tp):
                fresh(f"rank{r}")
                t = time.perf_counter()
                ck, src, plan = H.remote_plan(REPO_ID, a.tp, a.moe)
                H.rank_slice_remote(ck, src, plan, scratch / f"rank{r}" / "out", [r], gap=a.merge_gap,
                                    parallel=a.parallel)
                rows.append((r, hub.state.fetched(), len(hub.state.gets), time.perf_counter() - t))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"source {a.src} ({whole_b:,} bytes over HTTP for snapshot_download), tp {a.tp}, moe {a.moe}, "
          f"merge-gap {a.merge_gap}")
    print(f"{'':>14} {'bytes fetched':>14} {'requests':>9} {'wall s':>8} {'bytes/whole':>12} {'time/whole':>11}")
    print(f"{'whole repo':>14} {whole_b:>14,} {'':>9} {whole_s:>8.3f} {1:>12.3f} {1:>11.3f}")
    for r, b, n, s in rows:
        print(f"{'rank ' + str(r):>14} {b:>14,} {n:>9,} {s:>8.3f} {b / whole_b:>12.3f} {s / whole_s:>11.3f}")
    tot = sum(b for _, b, _, _ in rows)
    print(f"{'all ranks':>14} {tot:>14,} {'':>9} {sum(s for *_, s in rows):>8.3f} {tot / whole_b:>12.3f}"
          f" {sum(s for *_, s in rows) / whole_s:>11.3f}   (vs {a.tp} x whole = {a.tp:.3f})")


if __name__ == "__main__":
    main()
