"""The tables bench/gpu_serve.py prints last: one row per served config plus exllamav3, then
ours / exllamav3 per column, from each measurement's summary; and the schedule of a burst of
requests from the server's step trace (GET /v1/engine/steps)."""

from __future__ import annotations

import collections
import statistics


def ctx_cases(a) -> list[tuple]:
    """(result key, streams, prompt tokens) of the long-context phases: keyed by the stream count
    alone when ``--ctx`` has one value (the tables and JSON as before), else "N@CTX"."""
    return [(n if len(a.ctx) == 1 else f"{n}@{c}", n, c) for c in a.ctx for n in a.ctx_streams]


def columns(a) -> list[tuple[str, str]]:
    """(summary key, table header) in table order."""
    cols = [("single_tok_s", "1 stream tok/s")]
    cols += [(f"streams_{n}_tok_s", f"{n} streams") for n in a.streams]
    cols += [(f"ctx_{key}_tok_s", f"{n} stream{'s' if n > 1 else ''} @ctx{c}") for key, n, c in ctx_cases(a)]
    if getattr(a, "join", None):
        n, c, m = a.join
        cols += [("join_stall_ms", f"stall ms, {m} join {n} @ctx{c}"), ("join_ttft_ms", f"TTFT ms of the {m}")]
    cols += [("ttft_cold_ms", f"TTFT {a.prompt_len} cold ms"), ("ttft_hit_ms", f"TTFT {a.prompt_len} prefix-hit ms"),
             ("ttft_server_cold_ms", "its server's own cold ms"),
             ("mem_gb", "GPU mem GB" if a.device.startswith("cuda") else "RSS GB"),
             ("ready_s", "ready after s")]      # start-up: load, KV budget, graph captures
    if getattr(a, "seeded", 0):
        cols.append(("seeded", f"seeded text alone = among {a.seeded}"))
    return cols


def summarize(res: dict) -> dict:
    """The table's numbers from one measurement (ours or exllamav3)."""
    out = {}
    if "single" in res:
        out["single_tok_s"] = res["single"]["decode_tok_s"]
        out["single_ttft_ms"] = res["single"]["ttft_ms"]
    for n, g in res.get("streams", {}).items():
        out[f"streams_{n}_tok_s"] = g["tok_s"]
        out[f"streams_{n}_per_stream_tok_s"] = g["per_stream_decode_tok_s_median"]
    for n, g in res.get("ctx", {}).items():
        out[f"ctx_{n}_tok_s"] = g["decode_tok_s"]
    if "join" in res:
        out["join_stall_ms"] = res["join"]["stall_ms_max"]
        out["join_ttft_ms"] = res["join"]["joiner_ttft_ms_median"]
    if "ttft" in res:
        out["ttft_cold_ms"] = res["ttft"]["cold_ms"]
        out["ttft_hit_ms"] = res["ttft"]["hit_ms"]
        if res["ttft"].get("server_cold_ms") is not None:     # our server's histogram (exllamav3: none)
            out["ttft_server_cold_ms"] = res["ttft"]["server_cold_ms"]
    if res.get("memory"):
        out["mem_gb"] = res["memory"]["gb"]
    if "seeded" in res:
        r = res["seeded"]
        out["seeded"] = "yes" if r["same"] else f"no (token {r['first_difference']})"
    return out


def md_table(head: list[str], rows: list[list[str]]) -> str:
    w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |",
           "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    out += ["| " + " | ".join(r[i].ljust(w[i]) for i in range(len(head))) + " |" for r in rows]
    return "\n".join(out)


def _fmt(x, key: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if key == "mem_gb":
        return f"{x:.2f}"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def tables(a, named: list[tuple[str, dict | None]], ref: dict | None) -> str:
    """Results table (one row per config, then exllamav3), then ours/exllamav3 per column."""
    cols = columns(a)
    head = ["config"] + [h for _, h in cols]
    rows = [[name] + [_fmt((s or {}).get(k), k) for k, _ in cols] for name, s in named]
    ratio_rows = []
    for name, s in named:
        if name == "exllamav3":
            continue
        cells = []
        for k, _ in cols:
            x, y = (s or {}).get(k), (ref or {}).get(k)
            cells.append(f"{x / y:.2f}x" if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else "-")
        ratio_rows.append([name] + cells)
    return (md_table(head, rows) + "\n\nours / exllamav3 (tok/s: > 1 is faster; ms and memory: < 1 is less)\n\n"
            + md_table(head, ratio_rows))


def burst_schedule(steps: list[dict], t0: float, keep: int = 12) -> list[dict]:
    """The server's steps from ``t0`` (time.monotonic()) until the last one that admitted a
    sequence, and one more (at most ``keep``), times in ms from ``t0``: how a burst of prompts was
    scheduled."""
    steps = [s for s in steps if s["t"] >= t0]
    last = max((i for i, s in enumerate(steps) if s.get("admitted")), default=-1)
    out = []
    for s in steps[:min(last + 2, keep)]:
        d = {k: s.get(k) for k in ("path", "seqs", "rows", "prefill", "ms")}
        d["at_ms"] = round((s["t"] - t0) * 1e3, 2)
        d["admitted"] = [[round((a - t0) * 1e3, 2) for a in pair] for pair in s.get("admitted", [])]
        out.append(d)
    return out


def burst_line(steps: list[dict]) -> str:
    """``at+ms path rows(prefill)`` per step, with the received..queued ms of the sequences it admitted."""
    parts = []
    for s in steps:
        adm = s["admitted"]
        extra = f" adm {len(adm)} recv {min(a for a, _ in adm):.0f}-{max(a for a, _ in adm):.0f} " \
                f"queued {min(q for _, q in adm):.0f}-{max(q for _, q in adm):.0f}" if adm else ""
        parts.append(f"{s['at_ms']:.0f}+{s['ms'] or 0:.1f} {s['path']} {s['rows']}({s['prefill']}){extra}")
    return "; ".join(parts)


def steady_steps(steps: list[dict], streams: int) -> dict:
    """Median ms and median start-to-start interval of the steps that held every stream."""
    full = [s for s in steps if s.get("seqs") == streams]
    gaps = [b["t"] - a["t"] for a, b in zip(full, full[1:], strict=False) if b["t"] > a["t"]]
    paths = collections.Counter(s.get("path") for s in full)
    return {"steps": len(full), "paths": dict(paths),
            "step_ms_median": statistics.median(s["ms"] for s in full) if full else None,
            "interval_ms_median": 1e3 * statistics.median(gaps) if gaps else None}
