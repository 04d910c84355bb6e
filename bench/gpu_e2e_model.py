"""End-to-end decode on a whole EXL3 checkpoint: our runtime vs exllamav3 1.6.5, same GPU, same run.

    python3 bench/gpu_e2e_model.py CKPT [--batch 1,8] [--steps 64] [--warmup 8] [--prompt-len 32]
        [--max-len 256] [--impls ours:cuda,ours:triton,exllamav3] [--json OUT.json]

Made for the synthetic GLM-4.5-Air-shaped checkpoint of bench/synth_checkpoint.py (the anchor of
serving-expectations.md, "End-to-end anchor"), but any GQA/MoE checkpoint both runtimes load works.
Per impl: load, prefill a short prompt per row (the same token ids for every impl), then greedy
decode (argmax fed back on the GPU): `--warmup` steps, then `--steps` timed steps.

- ``ours:<backend>``: ``load_runner(CKPT, device="cuda", backend=<backend>)``, then ``Runner.step``
  per decode step as the server runs it (paged KV cache, the CUDA graph of the batch bucket replayed,
  greedy tokens back to the host), timed with CUDA events. ``ours:<backend>:unfused`` (or
  ``:fused``) loads with ``EXL3TOOLS_FUSED=0`` (``1``): the decode step's torch glue instead of
  the fused Triton kernels (docs/gpu.md "Fused decode step"), side by side in one run;
  ``:shared-apart``: fused, but the shared expert in its own linears (``EXL3TOOLS_FUSED_SHARED=0``);
  ``:pair-tiles``: fused, the MoE in pair-order tiles (``EXL3TOOLS_PAIR_TILES=1``, runtime/preview.py).
  ``:gemv-prologue``: fused, linears and expert slots of one row without a had_in launch
  (``EXL3TOOLS_GEMV_PROLOGUE=1``, cuda_gemv.GEMV_PRO_MAX_ROWS); ``:grouped``: fused, q/k/v and a
  dense MLP's gate/up as one grouped call each (``EXL3TOOLS_GROUPED_PROJ=1``, cuda_group.CudaGroup);
  ``:grouped-prologue``: both; ``:act-input``: fused, the MoE down projection's input pass computing
  silu(gate) * up (``EXL3TOOLS_ACT_INPUT=1``); ``:stack``: grouped, gemv-prologue and act-input;
  ``:expert-groups``: fused, the MoE of 2+ tokens in one tile per expert (``EXL3TOOLS_EXPERT_GROUPS=1``,
  the default since 2026-12-03); ``:no-expert-groups``: the same opted out (one row per pair);
  ``:wide-groups``: the expert groups past 512 pairs too (batch 57+, ``EXL3TOOLS_WIDE_GROUPS=1``);
  ``:fused-mla``: MLA models (DeepSeek-V3, GLM-5) with the fused glue around their attention
  (``EXL3TOOLS_FUSED_MLA=1``, runtime/fused_step.py FusedMlaStep, the default on CUDA since
  2026-12-03); ``:no-fused-mla``: the same opted out (the torch loop around the attention);
  ``:units16`` / ``:units64``: the default with tile units of 16 / 64 k-tiles (cuda_gemv.TILE_UNIT_KTILES);
  ``:chained``: the defaults stepped as ``serve`` steps them (``Runner.step_chained``: step N + 1
  launched on step N's device tokens before the host reads them, so the host's work overlaps the GPU's).
- ``exllamav3``: its own API as its examples use it. Mode "forward": ``model.prefill`` then one
  ``model.forward`` per step on a rectangular cache batch (``attn_mode flash_attn``, ``batch_shape``),
  CUDA events. Mode "generator": ``Generator`` + ``ArgmaxSampler`` jobs, one per row, no stop
  conditions; wall time of ``iterate()`` calls once every job is past the warm-up, tokens counted
  from the results (tokens/s as a user sees it).

Reported per row: ms/step, tokens/s (= batch x steps / time), weight bytes read per step from the
checkpoint headers (see ``step_bytes``), the fraction of the HBM roofline (bytes / 4.26e12 B/s over
the step time) and ours/exllamav3 tokens/s. Nothing here runs in CI; the pure functions are
tested in tests/test_synth_checkpoint.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HBM = 4.26e12          # measured H200 HBM read rate, B/s (serving-expectations.md §6)
IMPL_KINDS = ("ours", "exllamav3")
# ours:<backend>:<variant> -> environment while the runner loads (docs/gpu.md "Fused decode step")
VARIANTS = {"": {}, "fused": {"EXL3TOOLS_FUSED": "1"}, "unfused": {"EXL3TOOLS_FUSED": "0"},
            "shared-apart": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_FUSED_SHARED": "0"},
            "pair-tiles": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_PAIR_TILES": "1"},
            "gemv-prologue": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_GEMV_PROLOGUE": "1"},
            "grouped": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_GROUPED_PROJ": "1"},
            "grouped-prologue": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_GROUPED_PROJ": "1", "EXL3TOOLS_GEMV_PROLOGUE": "1"},
            "act-input": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_ACT_INPUT": "1"},
            "expert-groups": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_EXPERT_GROUPS": "1"},
            "no-expert-groups": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_EXPERT_GROUPS": "0"},
            "wide-groups": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_WIDE_GROUPS": "1"},
            "fused-mla": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_FUSED_MLA": "1"},
            "no-fused-mla": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_FUSED_MLA": "0"},
            "units16": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_TILE_UNIT_KTILES": "16"},
            "units64": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_TILE_UNIT_KTILES": "64"},
            "chained": {},      # the defaults, stepped as the server steps them (_ours_runner)
            "stack": {"EXL3TOOLS_FUSED": "1", "EXL3TOOLS_GROUPED_PROJ": "1", "EXL3TOOLS_GEMV_PROLOGUE": "1",
                      "EXL3TOOLS_ACT_INPUT": "1"}}


# ------------------------------------------------------------------ pure helpers (CPU-tested)
def parse_ints(s: str) -> list[int]:
    out = [int(x) for x in s.split(",") if x.strip()]
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8: {s!r}")
    return out


def parse_impls(s: str) -> list[str]:
    """``ours:<backend>`` (backend name for load_runner) or ``exllamav3``; order kept, no repeats."""
    out: list[str] = []
    for raw in s.split(","):
        x = raw.strip()
        if not x:
            continue
        kind, _, backend = x.partition(":")
        if kind == "ours" and backend and backend.partition(":")[2] in VARIANTS:
            pass
        elif kind == "exllamav3" and not backend:
            pass
        else:
            raise argparse.ArgumentTypeError(f"unknown impl {x!r} (use ours:<backend>[:" + "|:".join(v for v in VARIANTS if v) + "] or exllamav3)")
        if x not in out:
            out.append(x)
    if not out:
        raise argparse.ArgumentTypeError("no impls given")
    return out


def linear_bytes(k: int, n: int, bits: float) -> int:
    """Bytes one EXL3 linear streams per step: trellis k·n·K/8 plus fp16 suh and svh."""
    return int(k * n * bits / 8) + 2 * (k + n)


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct routed experts a step touches per layer with uniform routing: E(1 - (1 - k/E)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


DENSE_FP32 = (".kv_b_proj.weight", ".indexer.wk.weight", ".indexer.weights_proj.weight")


def model_bytes(ckpt_dir) -> dict:
    """What step_bytes needs, from the safetensors headers and config.json (no tensor data read)."""
    from exl3tools.checkpoint import Checkpoint
    from exl3tools.layout import scan_refs

    ck = Checkpoint.open(ckpt_dir)
    cfg = ck.config
    L = int(cfg["num_hidden_layers"])
    sc = scan_refs(ck.tensors, L)
    layers: dict[int, dict] = {}
    head = 0
    for lin in sc.linears.values():
        b = linear_bytes(lin.k, lin.n, lin.bits or 0) + (2 * lin.n if lin.has_bias else 0)
        if lin.family == "head":
            head += b
            continue
        if lin.layer is None or lin.layer >= L:
            continue                                   # MTP layers are not on the decode path
        d = layers.setdefault(lin.layer, {"attention": 0, "dense_mlp": 0, "shared_experts": 0, "other": 0,
                                          "experts": {}, "router": 0, "norms": 0})
        if lin.family == "experts":
            d["experts"][lin.expert] = d["experts"].get(lin.expert, 0) + b
        elif lin.family in d:
            d[lin.family] += b
        else:
            d["other"] += b
    hidden = int(cfg["hidden_size"])
    norms_final = 0
    for name, ref in ck.tensors.items():
        nb = ref.info.nbytes
        if name.startswith("model.layers.") and (name.endswith(".mlp.gate.weight")
                                                  or name.endswith(".mlp.gate.e_score_correction_bias")):
            li = int(name.split(".")[2])
            if li in layers:
                layers[li]["router"] += nb
        elif name.startswith("model.layers.") and name.endswith("norm.weight"):
            li = int(name.split(".")[2])
            if li in layers:
                layers[li]["norms"] += nb
        elif name.startswith("model.layers.") and name.endswith(DENSE_FP32):
            li = int(name.split(".")[2])
            if li in layers:      # MLA kv_b_proj, DSA indexer projections: 16-bit on disk, fp32 in the runtime
                layers[li]["other"] += 2 * nb
        elif name == "model.norm.weight":
            norms_final = nb
    emb = ck.tensors.get("model.embed_tokens.weight")
    row = (emb.info.nbytes // emb.info.shape[0]) if emb is not None else 2 * hidden
    return {"layers": layers, "head": head, "final_norm": norms_final, "embed_row": row,
            "top_k": int(cfg.get("num_experts_per_tok") or 0)}


def step_bytes(mb: dict, batch: int, distinct: dict[int, float] | float | None = None) -> dict:
    """Weight bytes one decode step of ``batch`` rows reads (serving-expectations.md §8): every EXL3
    linear on the path (trellis + suh + svh, + bias), routed experts actually touched (``distinct``:
    per layer or one number; default the uniform-routing expectation), shared experts, routers,
    norms, lm_head and ``batch`` embedding rows. KV-cache reads are not counted (short context)."""
    out = {"attention": 0.0, "dense_mlp": 0.0, "experts": 0.0, "shared_experts": 0.0, "router": 0.0,
           "norms": float(mb["final_norm"]), "head": float(mb["head"]), "embed": float(batch * mb["embed_row"]),
           "other": 0.0}
    touched = []
    for li, d in sorted(mb["layers"].items()):
        for key in ("attention", "dense_mlp", "shared_experts", "other", "router", "norms"):
            out[key] += d[key]
        ex = d["experts"]
        if ex:
            E = len(ex)
            if isinstance(distinct, dict):
                n = distinct.get(li, 0.0)
            elif distinct is not None:
                n = float(distinct)
            else:
                n = expected_distinct_experts(E, mb["top_k"], batch)
            n = min(float(n), E)
            touched.append(n)
            out["experts"] += n * sum(ex.values()) / E
    out["total"] = sum(out.values())
    out["distinct_experts_per_layer"] = sum(touched) / len(touched) if touched else 0.0
    return out


def roofline_fraction(nbytes: float, ms_per_step: float, bw: float = HBM) -> float:
    return (nbytes / bw) / (ms_per_step / 1e3) if ms_per_step > 0 else 0.0


def make_prompts(batch: int, length: int, vocab: int, seed: int = 1234) -> list[list[int]]:
    """Deterministic prompts, BOS 1 then ids in [6, min(vocab, 2048)) (real tokenizer ids of the
    fixture tokenizer the synthetic checkpoint carries); one distinct prompt per row."""
    import random

    rng = random.Random(seed)
    hi = max(7, min(vocab, 2048))
    return [[1] + [rng.randrange(6, hi) for _ in range(length - 1)] for _ in range(batch)]


def finish_rows(rows: list[dict], bytes_by_batch: dict[int, dict]) -> list[dict]:
    """Add bytes, roofline and ours/exllamav3 ratios (vs its generator and vs its bare forward),
    against exllamav3's row of the same ``round`` where there is one (``--rounds``)."""
    ref = {(r.get("round", 1), r["batch"], r["mode"]): r["tokens_per_s"] for r in rows
           if r["impl"] == "exllamav3" and r.get("tokens_per_s")}
    for r in rows:
        if not r.get("ms_per_step"):
            continue
        b = bytes_by_batch[r["batch"]]["total"]
        r["weight_bytes_per_step"] = int(b)
        r["roofline_fraction"] = roofline_fraction(b, r["ms_per_step"])
        if r["impl"] != "exllamav3":
            for mode in ("generator", "forward"):
                x = ref.get((r.get("round", 1), r["batch"], mode)) or next(
                    (v for (_, bb, m), v in ref.items() if bb == r["batch"] and m == mode), None)
                r[f"vs_exllamav3_{mode}"] = r["tokens_per_s"] / x if x else None
    return rows


def round_medians(rows: list[dict]) -> str:
    """With ``--rounds`` > 1: per impl, mode and batch, the median tok/s over the rounds and the
    spread (max / min - 1); identical impls in one process differ by 5-10 % (docs/gpu.md)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("tokens_per_s"):
            groups.setdefault((r["impl"], r.get("mode") or "-", r["batch"]), []).append(r["tokens_per_s"])
    out = ["| impl | mode | batch | rounds | median tok/s | spread |", "|---|---|---|---|---|---|"]
    for (impl, mode, batch), v in groups.items():
        out.append(f"| {impl} | {mode} | {batch} | {len(v)} | {statistics.median(v):.1f} | "
                   f"{100 * (max(v) / min(v) - 1):.1f} % |")
    return "\n".join(out)


def format_table(rows: list[dict]) -> str:
    head = ("impl", "mode", "batch", "ms/step", "tok/s", "MB/step", "roofline", "vs exl3 gen", "vs exl3 fwd", "note")
    lines = []
    for r in rows:
        def f(k, fmt, r=r):
            return fmt.format(r[k]) if r.get(k) is not None else "-"
        lines.append((r["impl"], r.get("mode") or "-", str(r["batch"]), f("ms_per_step", "{:.3f}"),
                      f("tokens_per_s", "{:.1f}"),
                      f"{r['weight_bytes_per_step'] / 1e6:.1f}" if r.get("weight_bytes_per_step") else "-",
                      f"{100 * r['roofline_fraction']:.1f} %" if r.get("roofline_fraction") else "-",
                      f("vs_exllamav3_generator", "{:.2f}x"), f("vs_exllamav3_forward", "{:.2f}x"),
                      r.get("error") or r.get("note") or ""))
    w = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |",
           "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    out += ["| " + " | ".join(x[i].ljust(w[i]) for i in range(len(head))) + " |" for x in lines]
    return "\n".join(out)


# ------------------------------------------------------------------ GPU side
def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_cuda(step, n: int) -> float:
    """ms per call of ``step()`` over n calls, CUDA events around the whole loop."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def run_ours(ckpt: str, backend: str, batches: list[int], a) -> list[dict]:
    import torch

    from exl3tools.runtime.runner import load_runner

    impl = f"ours:{backend}"
    backend, _, variant = backend.partition(":")
    env = VARIANTS[variant]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)          # read when the decode step is built, i.e. during the load
    t0 = time.perf_counter()
    try:
        runner = load_runner(ckpt, device="cuda", backend=backend, max_context=a.max_len,
                             max_cache_tokens=max(batches) * a.max_len, max_num_seqs=max(batches))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    decoder = getattr(getattr(runner, "paged", None), "decoder", None)
    fused = getattr(decoder, "_fused", None) is not None
    print(f"[{impl}] loaded in {load_s:.2f} s, decode {runner.decode_mode}, fused glue {fused}", flush=True)
    rows = []
    for B in batches:
        prompts = make_prompts(B, a.prompt_len, runner.vocab_size)
        row = {"impl": impl, "batch": B, "steps": a.steps, "load_s": round(load_s, 3)}
        try:
            _ours_runner(runner, prompts, a, row)
            row["tokens_per_s"] = B * 1e3 / row["ms_per_step"]
        except Exception as exc:  # noqa: BLE001 - one failing impl must not lose the others
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
        print(f"[{impl}] batch {B}: {row}", flush=True)
        rows.append(row)
    runner.close()
    del runner
    _free()
    return rows


def _profile(step, n: int, title: str) -> None:
    """Top kernels of n graph-replayed steps by device time (CUPTI traces graph kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    print(f"--- profile: {title}, {n} steps, sorted by {key}")
    print(events.table(sort_by=key, row_limit=30, max_name_column_width=70))


def _ours_runner(runner, prompts, a, row) -> None:
    """What the server runs: Runner.step over the paged cache (decode steps replay the CUDA graph of
    their batch bucket), logits kept on the device, greedy tokens back to the host every step."""
    import torch

    from exl3tools.runtime.sampling import DeviceTokens

    decoder = getattr(getattr(runner, "paged", None), "decoder", None)
    row["mode"] = f"paged-{runner.decode_mode}" + ("+fused" if getattr(decoder, "_fused", None) is not None else "")
    ids = list(range(len(prompts)))
    for s in ids:
        runner.add_sequence(s)
    try:
        t = time.perf_counter()
        first = runner.step(list(zip(ids, prompts, strict=True)), device_logits=True)
        state = {"tok": first.argmax(-1).tolist()}
        _sync()
        row["prefill_ms"] = 1e3 * (time.perf_counter() - t)
        row["kv_cache_bytes"] = int(runner.paged.pool.nbytes())

        def step():
            logits = runner.step([(s, [t]) for s, t in zip(ids, state["tok"], strict=True)], device_logits=True)
            state["tok"] = logits.argmax(-1).tolist()

        def chained():
            # the server's loop (server/engine.py _chain): step N + 1 is launched on step N's device
            # tokens before the host reads them (their pinned copy waits on an event, not on the
            # stream), so the host's work of a step runs while the GPU runs the one before
            if "dev" not in state:
                state["dev"] = DeviceTokens(torch.tensor(state["tok"], device=first.device))
            prev = state["dev"]
            logits = runner.step_chained(ids, prev.rows())
            state["dev"] = DeviceTokens(logits.argmax(-1))
            runner.commit_tokens(list(zip(ids, prev.tolist(), strict=True)))
        if row["impl"].endswith(":chained"):
            if not runner.can_chain:
                raise RuntimeError("this runner cannot chain decode steps")
            row["mode"] += "+chained"
            step = chained
        for _ in range(a.warmup):
            step()
        row["ms_per_step"] = _time_cuda(step, a.steps)
        if getattr(a, "profile", 0):
            _profile(step, a.profile, f"{row['impl']} batch {len(prompts)}")
        if "dev" in state:          # the last chained step's samples (its input tokens are committed)
            state["tok"] = state["dev"].tolist()
        row["last_tokens"] = state["tok"]       # (the same with and without chaining: tests)
    finally:
        for s in ids:
            runner.free_sequence(s)


def load_exllamav3(ckpt: str, max_num_tokens: int, n_caches: int = 1, device: str = "cuda:0"):
    """exllamav3 as its examples load it: Config.from_directory, Model.from_config, ``n_caches`` caches
    of ``max_num_tokens`` (multiple of its 256-token page; they must exist before load), model.load,
    Tokenizer. Returns (config, model, caches, tokenizer, load seconds). bench/gpu_serve.py uses it too."""
    import torch
    from exllamav3 import Cache, Config, Model, Tokenizer

    t0 = time.perf_counter()
    config = Config.from_directory(ckpt)
    model = Model.from_config(config)
    caches = [Cache(model, max_num_tokens=max_num_tokens) for _ in range(n_caches)]
    model.load(device=device, progressbar=False)
    tokenizer = Tokenizer.from_config(config)
    torch.cuda.synchronize()
    return config, model, caches, tokenizer, time.perf_counter() - t0


def run_exllamav3(ckpt: str, batches: list[int], a) -> list[dict]:
    try:
        import importlib.metadata

        from exllamav3 import ArgmaxSampler, Generator, Job
        version = importlib.metadata.version("exllamav3")
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError (no CUDA_HOME), build failures
        msg = f"exllamav3 not usable here: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"[exllamav3] skipped: {msg}", flush=True)
        return [{"impl": "exllamav3", "mode": m, "batch": B, "error": msg[:160]}
                for B in batches for m in a.exl3_modes]
    print(f"[exllamav3] version {version}", flush=True)
    config, model, cache_list, tokenizer, load_s = load_exllamav3(ckpt, max(batches) * a.max_len, len(a.exl3_modes))
    caches = dict(zip(a.exl3_modes, cache_list, strict=True))
    print(f"[exllamav3] loaded in {load_s:.2f} s", flush=True)
    V = config.vocab_size
    gen = Generator(model=model, cache=caches["generator"], tokenizer=tokenizer) if "generator" in caches else None
    rows = []
    for B in batches:
        prompts = make_prompts(B, a.prompt_len, V)
        for mode in a.exl3_modes:
            row = {"impl": "exllamav3", "mode": mode, "batch": B, "steps": a.steps, "load_s": round(load_s, 3),
                   "version": version}
            try:
                if mode == "forward":
                    _exl3_forward(model, caches[mode], V, prompts, a, row)
                else:
                    _exl3_generator(gen, Job, ArgmaxSampler, prompts, a, row)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
            print(f"[exllamav3] {mode} batch {B}: {row}", flush=True)
            rows.append(row)
    del gen
    try:
        model.unload()
    except Exception as exc:  # noqa: BLE001 - the rows are measured already
        print(f"[exllamav3] unload: {exc}", flush=True)
    del model, caches, cache_list
    _free()
    return rows


def _exl3_forward(model, cache, V, prompts, a, row) -> None:
    """Bare decode loop: prefill all but the last prompt token, then one forward per step."""
    import torch

    B = len(prompts)
    ids = torch.tensor(prompts, dtype=torch.long)
    shape = (B, a.max_len)
    t = time.perf_counter()
    model.prefill(ids[:, :-1], {"attn_mode": "flash_attn", "cache": cache, "past_len": 0, "batch_shape": shape})
    torch.cuda.synchronize()
    row["prefill_ms"] = 1e3 * (time.perf_counter() - t)
    state = {"tok": ids[:, -1:], "pos": ids.shape[1] - 1}

    def step():
        lg = model.forward(state["tok"], {"attn_mode": "flash_attn", "cache": cache, "past_len": state["pos"],
                                          "batch_shape": shape})
        state["tok"] = lg[:, -1, :V].argmax(-1, keepdim=True).cpu()   # to the host, as its examples do
        state["pos"] += 1
    for _ in range(a.warmup):
        step()
    row["ms_per_step"] = _time_cuda(step, a.steps)
    row["tokens_per_s"] = B * 1e3 / row["ms_per_step"]


def _exl3_generator(gen, Job, ArgmaxSampler, prompts, a, row) -> None:
    """User-visible tokens/s: jobs through exllamav3's Generator, timed once all are decoding."""
    import torch

    for i, p in enumerate(prompts):
        gen.enqueue(Job(input_ids=torch.tensor([p], dtype=torch.long), max_new_tokens=a.warmup + a.steps + 4,
                        sampler=ArgmaxSampler(), stop_conditions=None, identifier=i))
    counts = [0] * len(prompts)

    def iterate() -> int:
        n = 0
        for r in gen.iterate():
            if r.get("stage") == "streaming" and "token_ids" in r:
                k = int(r["token_ids"].numel())
                counts[r["identifier"]] += k
                n += k
        return n
    t = time.perf_counter()
    while min(counts) < a.warmup and gen.num_remaining_jobs():
        iterate()
    row["prefill_plus_warmup_ms"] = 1e3 * (time.perf_counter() - t)
    torch.cuda.synchronize()
    t, toks, its = time.perf_counter(), 0, 0
    while its < a.steps and gen.num_remaining_jobs():
        toks += iterate()
        its += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    while gen.num_remaining_jobs():   # drain, so the cache is free for the next batch
        iterate()
    row["ms_per_step"] = 1e3 * dt / max(its, 1)
    row["tokens_per_s"] = toks / dt if dt > 0 else None
    row["iterations"], row["tokens"] = its, toks
    if toks != its * len(prompts):
        row["note"] = f"{toks} tokens in {its} iterations (expected {its * len(prompts)})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--batch", type=parse_ints, default=[1, 8])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256, help="cache length per row (multiple of 256)")
    ap.add_argument("--impls", type=parse_impls, default=parse_impls("ours:cuda,ours:triton,exllamav3"))
    ap.add_argument("--exl3-modes", type=lambda s: [m for m in s.split(",") if m], default=["generator", "forward"],
                    help="exllamav3 measurements: generator,forward")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the impl list this many times in turn (A B A B ...): every row keeps its round")
    ap.add_argument("--profile", type=int, default=0,
                    help="after timing, profile this many of our graph-replayed steps: top kernels by device time")
    a = ap.parse_args(argv)
    if a.max_len % 256 or a.prompt_len + a.warmup + a.steps + 8 > a.max_len:
        ap.error("--max-len must be a multiple of 256 and hold prompt + warmup + steps (+ 8)")
    if a.prompt_len < 2 or a.steps < 1 or a.warmup < 0:
        ap.error("--prompt-len >= 2, --steps >= 1, --warmup >= 0")
    if any(m not in ("generator", "forward") for m in a.exl3_modes):
        ap.error("--exl3-modes takes generator and/or forward")
    if a.rounds < 1:
        ap.error("--rounds >= 1")

    import torch

    if not torch.cuda.is_available():
        print("gpu_e2e_model: needs a CUDA device", file=sys.stderr)
        return 2
    mb = model_bytes(a.ckpt)
    bytes_by_batch = {B: step_bytes(mb, B) for B in a.batch}
    for B, d in bytes_by_batch.items():
        print(f"weight bytes per step, batch {B}: {d['total'] / 1e6:.1f} MB (head {d['head'] / 1e6:.1f} MB, "
              f"{d['distinct_experts_per_layer']:.1f} distinct experts/layer)", flush=True)
    rows: list[dict] = []
    for rnd in range(1, a.rounds + 1):
        for impl in a.impls:
            try:
                if impl == "exllamav3":
                    got = run_exllamav3(a.ckpt, a.batch, a)
                else:
                    got = run_ours(a.ckpt, impl.split(":", 1)[1], a.batch, a)
            except Exception as exc:  # noqa: BLE001 - e.g. backend not built here, load failure
                msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
                print(f"[{impl}] failed: {msg}", flush=True)
                modes = a.exl3_modes if impl == "exllamav3" else [None]
                got = [{"impl": impl, "mode": m, "batch": B, "error": msg} for B in a.batch for m in modes]
                _free()
            for r in got:
                r["round"] = rnd
                if a.rounds > 1 and not r.get("error"):
                    r["note"] = f"round {rnd}"
            rows += got
    finish_rows(rows, bytes_by_batch)
    print()
    print(format_table(rows))
    if a.rounds > 1:
        print()
        print(round_medians(rows))
    out = {"checkpoint": str(a.ckpt), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "hbm_bytes_per_s": HBM, "steps": a.steps, "warmup": a.warmup, "prompt_len": a.prompt_len,
           "bytes_per_step": {str(B): d for B, d in bytes_by_batch.items()}, "rows": rows}
    print(json.dumps(out, indent=1, default=str))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
