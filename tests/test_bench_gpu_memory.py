"""bench/gpu_memory.py's trace replay (the GPU part runs on the device): the peak of live bytes and
who held them, on a hand-written allocator trace."""

import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_memory as gm  # noqa: E402

F = lambda path, line, name: [{"filename": "/usr/lib/torch/x.py", "line": 1, "name": "t"},  # noqa: E731
                              {"filename": path, "line": line, "name": name}]


def test_peak_live_groups_by_our_innermost_frame():
    a = F("/r/exl3tools/runtime/layers.py", 10, "forward")
    b = F("/r/kernels/dispatch.py", 20, "tiles")
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": a},
        {"action": "alloc", "addr": 2, "size": 50, "frames": b},
        {"action": "alloc", "addr": 9, "size": 1 << 31, "frames": a},      # the KV pool: not counted
        {"action": "free_requested", "addr": 2, "size": 50, "frames": b},
        {"action": "alloc", "addr": 3, "size": 30, "frames": a},
        {"action": "alloc", "addr": 4, "size": 40, "frames": []},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": a},
    ]
    best, groups = gm.peak_live({"device_traces": [trace]})
    assert best == 170                                  # 100 + 30 + 40 (50 was freed before)
    assert groups == [("runtime/layers.py:10 forward", 130, 2), ("(outside exl3tools)", 40, 1)]
    assert gm.owner(b) == "kernels/dispatch.py:20 tiles"


def test_the_peak_and_the_live_set_at_the_end():
    a = F("/r/exl3tools/runtime/layers.py", 10, "forward")
    trace = [
        {"action": "alloc", "addr": 1, "size": 500, "frames": a},           # the load's transient peak
        {"action": "free_requested", "addr": 1, "size": 500, "frames": a},
        {"action": "alloc", "addr": 2, "size": 40, "frames": a},            # kept
        {"action": "alloc", "addr": 3, "size": 60, "frames": []},           # a transient
        {"action": "free_requested", "addr": 3, "size": 60, "frames": []},
    ]
    assert gm.peak_live({"device_traces": [trace]})[0] == 500
    assert gm.peak_live({"device_traces": [trace]}, at_end=True) == (40, [("runtime/layers.py:10 forward", 40, 1)])


def test_pools_split_the_default_pool_from_graph_pools():
    segs = [{"device": 0, "segment_pool_id": (0, 0), "total_size": 100, "allocated_size": 60},
            {"device": 0, "segment_pool_id": (1, 2), "total_size": 30, "allocated_size": 5},
            {"device": 0, "segment_pool_id": (0, 0), "total_size": 20, "allocated_size": 20},
            {"device": 1, "segment_pool_id": (0, 0), "total_size": 999, "allocated_size": 0}]
    assert gm.pools({"segments": segs}) == [("default", 120, 80), ("graph pool 1.2", 30, 5)]
