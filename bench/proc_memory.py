"""Memory of a process tree, as bench/gpu_serve.py samples a server after every phase: nvidia-smi's
per-process figure (tensor-parallel workers included), else the change of the GPUs' total used
memory since a baseline, else peak RSS from /proc."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def run_quiet(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (tensor-parallel workers), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo and len(out) < 4096:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def gpu_total_used_mib() -> float | None:
    if not shutil.which("nvidia-smi"):
        return None
    txt = run_quiet(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"])
    try:
        return sum(float(x) for x in txt.split()) if txt else None
    except ValueError:
        return None


def gpu_proc_mib(pids: list[int]) -> float | None:
    """Summed used_memory of these pids over all GPUs (None: nvidia-smi absent or no pid matched, as
    inside a container with its own pid namespace)."""
    if not shutil.which("nvidia-smi"):
        return None
    txt = run_quiet(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
    if txt is None:
        return None
    want, total, hit = set(pids), 0.0, False
    for line in txt.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in want:
            try:
                total += float(parts[1])
                hit = True
            except ValueError:
                pass
    return total if hit else None


def rss_peak_bytes(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def memory_sample(pid: int, baseline_mib: float | None) -> dict:
    pids = process_tree(pid)
    mib = gpu_proc_mib(pids)
    if mib is not None:
        return {"gb": mib * 2**20 / 1e9, "source": "nvidia-smi per process", "pids": pids}
    used = gpu_total_used_mib()
    if used is not None and baseline_mib is not None:
        return {"gb": max(0.0, used - baseline_mib) * 2**20 / 1e9, "source": "nvidia-smi total used - baseline",
                "pids": pids}
    return {"gb": rss_peak_bytes(pids) / 1e9, "source": "peak RSS (VmHWM)", "pids": pids}


def keep_max_memory(res: dict, sample: dict) -> None:
    old = res.get("memory")
    if old is None or sample["gb"] > old["gb"]:
        res["memory"] = sample
