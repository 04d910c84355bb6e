"""The runtime's public contract: ``load_runner(path) -> Runner``; ``Runner.step(batch) -> logits``.

The HTTP server and ``exl3tools generate`` build on this and nothing deeper. A Runner owns the
model, the tokenizer and the KV caches of the sequences it was told about. ``step`` takes any mix
of prefill (many tokens for one sequence) and decode (one token for many sequences) and runs it as
one packed forward. With ``tp > 1`` the Runner lives on rank 0 and drives the other ranks.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from pathlib import Path
from typing import Hashable

import torch

from exl3tools.errors import CheckpointError, Exl3Error, RuntimeFailure, UsageError
from exl3tools.kernels.dispatch import resolve_backend
from exl3tools.runtime import distributed as D
from exl3tools.runtime.arch import BuildContext, arch_module
from exl3tools.runtime.loader import Layout, load_tokenizer, open_rank, resolve
from exl3tools.runtime.model import CausalLM
from exl3tools.runtime.tp import TPContext
from exl3tools.runtime.weights import WeightSource

DEFAULT_CACHE_TOKENS = 32768
GRAPH_MEMORY_FRACTION = 0.5   # the static KV cache may take at most this share of free GPU memory

log = logging.getLogger("exl3tools.runtime")


class CacheFullError(RuntimeFailure):
    """The KV cache budget (max_cache_tokens) cannot hold the requested tokens."""


class ContextLengthError(UsageError):
    """A sequence would grow past the model's max_context."""


def build_local_model(layout: Layout, rank: int, world: int, *, backend: str = "reference",
                      device: str = "cpu", max_context: int | None = None, moe: str = "tp") -> CausalLM:
    """Open this rank's directory (only it) and build the model part this rank runs.

    An unsliced checkpoint run with ``world > 1`` is planned in memory with the rank-slice rules
    (``moe``: "tp" or "ep") and each rank reads only the byte ranges of its cut."""
    ckpt, cut = open_rank(layout, rank)
    mod = arch_module(ckpt.architecture)
    device = rank_device(device, rank, world)
    block = ckpt.config.get("exl3tools") if layout.kind == "ranks" else None
    if cut:
        from exl3tools.rank_slice import plan_rank_slices

        block = plan_rank_slices(ckpt, world, moe).configs[rank]["exl3tools"]
    ctx = BuildContext(ckpt.config, WeightSource(ckpt), TPContext(world, rank), cut, block, backend, device,
                       max_context)
    return mod.build(ctx)


# ------------------------------------------------------------------ worker side
def serve_rank(path: str, *, rank: int, world: int, port: int | None, backend: str = "reference",
               device: str = "cpu", max_context: int | None = None, moe: str = "tp", trace: bool = False) -> None:
    """Run rank ``rank`` (> 0): load, report, then execute rank 0's commands until 'stop'."""
    device = rank_device(device, rank, world)   # before the group: NCCL binds the current device
    D.init_group(rank, world, device, port)
    try:
        if trace:
            D.trace_opens_start()
        err, model = None, None
        try:
            model = build_local_model(resolve(path, world), rank, world, backend=backend, device=device,
                                      max_context=max_context, moe=moe)
        except Exl3Error as exc:
            err = exc
        D.exchange_status(err, D.trace_opens_stop() if trace else None)
        caches: dict = {}
        while True:
            cmd = D.broadcast()
            op = cmd[0]
            if op == "step":
                model.forward([(caches[s], toks) for s, toks in cmd[1]], all_logits=cmd[2])
            elif op == "add":
                caches[cmd[1]] = model.new_cache()
            elif op == "free":
                caches.pop(cmd[1], None)
            elif op == "mtp":  # speculative decoding with the MTP head, in lockstep with rank 0
                from exl3tools.runtime.mtp import worker_op

                worker_op(model, cmd)
            elif op == "stop":
                break
    finally:
        D.destroy()


# ------------------------------------------------------------------ rank 0 side
class Runner:
    """Model + tokenizer + KV caches; see module doc. Not thread-safe: call from one thread."""

    def __init__(self, model: CausalLM, ckpt_dir: Path, name: str, *, world: int = 1, procs=(),
                 max_cache_tokens: int = DEFAULT_CACHE_TOKENS, opened: dict | None = None,
                 graph_slots: int = 0, graph_max_len: int | None = None, graph_force: bool = False):
        self.model = model
        self.world, self._procs = world, list(procs)
        self.model_name = name
        self.vocab_size = model.info.vocab_size
        self.max_context = model.info.max_context
        self.max_cache_tokens = int(max_cache_tokens)
        self.opened_files = opened or {}       # rank -> files opened while loading (when traced)
        self._caches: dict[Hashable, object] = {}
        self._closed = False
        self.graph = None                      # a GraphDecoder when decode runs on the static path
        if graph_slots > 0:
            self.graph = self._graph_decoder(int(graph_slots), graph_max_len, graph_force)
        if self.graph is not None:
            self.max_context = self.graph.max_len
            self._free_rows = list(range(self.graph.batch))
        self._load_tokenizer(ckpt_dir)

    # -- graph decode (runtime/graph_decode.py): one static row per sequence
    def _graph_decoder(self, slots: int, max_len: int | None, force: bool):
        """A GraphDecoder of ``slots`` rows, or None (logged once) where the eager path must run."""
        from exl3tools.runtime.graph_decode import GraphDecoder

        m = self.model
        max_len = min(m.info.max_context, self.max_cache_tokens, max_len or m.info.max_context)
        why = None
        try:
            GraphDecoder.check(m)
        except Exl3Error as exc:
            why = str(exc)
        if why is None and m.embed.device.type != "cuda" and not force:
            why = "it needs a CUDA device"
        if why is None and m.embed.device.type == "cuda":
            need = GraphDecoder.cache_bytes(m, slots, max_len)
            free, _ = torch.cuda.mem_get_info(m.embed.device)
            if need > GRAPH_MEMORY_FRACTION * free:
                why = (f"its static KV cache ({slots} rows x {max_len} tokens = {need / 2**30:.1f} GiB) "
                       f"exceeds {GRAPH_MEMORY_FRACTION:.0%} of free GPU memory; lower --max-batch or "
                       f"--max-context")
        if why is None:
            try:
                gd = GraphDecoder(m, slots, max_len, graphs=m.embed.device.type == "cuda")
            except Exl3Error as exc:
                why = str(exc)
        if why is not None:
            log.warning("CUDA-graph decode off, decoding eagerly: %s", why)
            return None
        log.info("CUDA-graph decode on: %d rows x %d tokens, graphs %s", slots, max_len,
                 "on" if gd.graphs else "off (static path)")
        return gd

    # -- metadata
    def _load_tokenizer(self, d: Path) -> None:
        self.tokenizer = load_tokenizer(d / "tokenizer.json")  # unreadable/corrupt: a one-line error
        cfg = _json(d / "config.json") or {}
        gen = _json(d / "generation_config.json") or {}
        tcfg = _json(d / "tokenizer_config.json") or {}
        eos: set[int] = set()
        for src in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, list):
                eos.update(int(x) for x in src if isinstance(x, int))
        eos_tok = tcfg.get("eos_token")
        eos_tok = eos_tok.get("content") if isinstance(eos_tok, dict) else eos_tok
        if isinstance(eos_tok, str) and self.tokenizer is not None:
            tid = self.tokenizer.token_to_id(eos_tok)
            if tid is not None:
                eos.add(tid)
        self.eos_token_ids: set[int] = eos
        special = _json(d / "special_tokens_map.json") or {}
        self.eos_token: str | None = self._token_text(tcfg, special, "eos_token",
                                                      cfg.get("eos_token_id", gen.get("eos_token_id")))
        self.bos_token: str | None = self._token_text(tcfg, special, "bos_token",
                                                      cfg.get("bos_token_id", gen.get("bos_token_id")))
        self.generation_defaults: dict[str, float | int] = generation_defaults(gen)
        bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
        self.bos_token_id: int | None = bos if isinstance(bos, int) else None
        tmpl = tcfg.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if not isinstance(tmpl, str) and (d / "chat_template.jinja").is_file():
            tmpl = (d / "chat_template.jinja").read_text(encoding="utf-8")
        self.chat_template: str | None = tmpl if isinstance(tmpl, str) else None

    def _token_text(self, tcfg: dict, special: dict, key: str, ids) -> str | None:
        """The text of the bos/eos token, as HF tokenizers report it (and chat templates print it):
        tokenizer_config.json, then special_tokens_map.json (a string or {"content": ...}; an
        explicit null means none), then the tokenizer's text for config.json's id (the first, for a
        list)."""
        for src in (tcfg, special):
            if key in src:
                v = src[key]
                v = v.get("content") if isinstance(v, dict) else v
                return v if isinstance(v, str) else None
        tid = ids[0] if isinstance(ids, list) and ids else ids
        if isinstance(tid, int) and not isinstance(tid, bool) and self.tokenizer is not None:
            return self.tokenizer.id_to_token(tid)
        return None

    # -- sequences
    def add_sequence(self, seq_id: Hashable) -> None:
        if seq_id in self._caches:
            raise UsageError(f"sequence {seq_id!r} already exists")
        if self.graph is not None:
            if not self._free_rows:
                raise CacheFullError(f"all {self.graph.batch} graph-decode rows are in use")
            row = self._free_rows.pop(0)
            self.graph.reset_row(row)
            self._caches[seq_id] = _GraphSeq(row)
            return
        self._send(("add", seq_id))
        self._caches[seq_id] = self.model.new_cache()

    def free_sequence(self, seq_id: Hashable) -> None:
        c = self._caches.pop(seq_id, None)
        if isinstance(c, _GraphSeq):
            self.graph.reset_row(c.row)
            self._free_rows.append(c.row)
        elif c is not None:
            self._send(("free", seq_id))

    def sequence_length(self, seq_id: Hashable) -> int:
        return self._cache(seq_id).length

    def cache_tokens_used(self) -> int:
        return sum(c.length for c in self._caches.values())

    def cache_tokens_free(self) -> int:
        return max(0, self.max_cache_tokens - self.cache_tokens_used())

    def _cache(self, seq_id):
        try:
            return self._caches[seq_id]
        except KeyError:
            raise UsageError(f"unknown sequence {seq_id!r} (call add_sequence first)") from None

    # -- forward
    def step(self, batch: list[tuple[Hashable, list[int]]], *, all_logits: bool = False) -> torch.Tensor:
        """Append each sequence's new tokens to its cache; float32 logits ``[len(batch), vocab]``
        after each sequence's last new token (``all_logits``: ``[total new tokens, vocab]``)."""
        if self._closed:
            raise RuntimeFailure("runner is closed")
        if not batch:
            return torch.empty(0, self.vocab_size)
        seen, items, need = set(), [], 0
        for seq_id, toks in batch:
            if seq_id in seen:
                raise UsageError(f"sequence {seq_id!r} appears twice in one step")
            seen.add(seq_id)
            cache = self._cache(seq_id)
            toks = [int(t) for t in toks]
            if not toks:
                raise UsageError(f"sequence {seq_id!r}: no new tokens")
            bad = [t for t in toks if not 0 <= t < self.model.embed.shape[0]]
            if bad:
                raise UsageError(f"token id {bad[0]} out of range 0..{self.model.embed.shape[0] - 1}")
            if cache.length + len(toks) > self.max_context:
                raise ContextLengthError(f"sequence {seq_id!r} would reach {cache.length + len(toks)} tokens, "
                                         f"more than max_context {self.max_context}")
            need += len(toks)
            items.append((cache, toks))
        if need > self.cache_tokens_free():
            raise CacheFullError(f"KV cache full: {need} new tokens, {self.cache_tokens_free()} free "
                                 f"of {self.max_cache_tokens}")
        if self.graph is not None:
            return self._graph_step(items, all_logits)
        self._send(("step", [(s, [int(t) for t in toks]) for s, toks in batch], all_logits))
        try:
            return self.model.forward(items, all_logits=all_logits)
        except RuntimeError as exc:
            if self.world > 1:
                raise RuntimeFailure(f"tensor-parallel step failed: {str(exc).splitlines()[0]}") from exc
            raise

    def _graph_step(self, items: list, all_logits: bool) -> torch.Tensor:
        """Single new tokens: one GraphDecoder.step over every row (rows not in the batch stay put);
        several new tokens (prefill, a chunk): an eager forward into the rows' static slots."""
        gd = self.graph
        single = [] if all_logits else [i for i, (_, toks) in enumerate(items) if len(toks) == 1]
        multi = [i for i in range(len(items)) if i not in set(single)]
        out: list = [None] * len(items)
        if single:
            tokens, active = [0] * gd.batch, [False] * gd.batch
            for i in single:
                seq, toks = items[i]
                tokens[seq.row], active[seq.row] = toks[0], True
            logits = gd.step(torch.tensor(tokens, dtype=torch.int64), active)
            rows = logits[torch.tensor([items[i][0].row for i in single], device=logits.device)].float().cpu()
            for j, i in enumerate(single):
                out[i] = rows[j:j + 1]
        if multi:
            logits = gd.extend_rows([(items[i][0].row, items[i][1]) for i in multi],
                                    all_logits=all_logits).float().cpu()
            at = 0
            for i in multi:
                n = len(items[i][1]) if all_logits else 1
                out[i] = logits[at:at + n]
                at += n
        for seq, toks in items:
            seq.length += len(toks)
        return torch.cat(out, 0)

    def _send(self, cmd) -> None:
        if self.world > 1:
            try:
                D.broadcast(cmd)
            except RuntimeError as exc:
                raise RuntimeFailure(f"tensor-parallel peer lost: {str(exc).splitlines()[0]}") from exc

    # -- lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._caches.clear()
        if self.world > 1:
            try:
                D.broadcast(("stop",))
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass
            D.destroy()
            _reap(self._procs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _GraphSeq:
    """A sequence on the graph path: its row of the static cache and its length (host side)."""

    __slots__ = ("row", "length")

    def __init__(self, row: int):
        self.row, self.length = row, 0


def rank_device(device: str, rank: int, world: int) -> str:
    """A bare "cuda" under TP means one GPU per rank: cuda:LOCAL_RANK (torchrun) or cuda:rank."""
    if str(device) == "cuda" and world > 1:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return device


def _reap(procs, wait: float = 10.0) -> None:
    """Wait for our worker processes to exit; kill (by pid, ours only) any that do not."""
    for p in procs:
        try:
            p.wait(timeout=wait)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            p.kill()
            p.wait()


def generation_defaults(gen: dict) -> dict[str, float | int]:
    """generation_config.json's sampling values that are usable: ``temperature`` (>= 0),
    ``top_p`` (0 < p <= 1), ``top_k`` (>= 0, 0 = off). ``do_sample`` is not consulted (as vLLM):
    a file that names a temperature means it."""
    out: dict[str, float | int] = {}
    num = (int, float)
    t, p, k = gen.get("temperature"), gen.get("top_p"), gen.get("top_k")
    if isinstance(t, num) and not isinstance(t, bool) and 0 <= t < float("inf"):
        out["temperature"] = float(t)
    if isinstance(p, num) and not isinstance(p, bool) and 0 < p <= 1:
        out["top_p"] = float(p)
    if isinstance(k, int) and not isinstance(k, bool):
        out["top_k"] = max(0, k)
    return out


def _json(p: Path):
    try:
        return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None
    except (OSError, ValueError):
        return None


def _torchrun_env() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def load_runner(path, *, device: str = "cpu", tp: int = 1, backend: str = "auto",
                max_cache_tokens: int = DEFAULT_CACHE_TOKENS, max_context: int | None = None,
                moe: str = "tp", graph_decode: bool | str = False, graph_slots: int = 32,
                graph_max_len: int | None = None) -> Runner | None:
    """Load a checkpoint (unsliced, or a rank-slice output for ``tp`` ranks) and return its Runner.

    ``tp > 1`` spawns ranks 1..tp-1 as processes. Under torchrun (``RANK``/``WORLD_SIZE`` set)
    nothing is spawned: rank 0 gets the Runner; other ranks serve rank 0 inside this call and get
    ``None`` back once rank 0 closes its Runner. ``moe`` ("tp" | "ep") only matters for an
    unsliced checkpoint with ``tp > 1`` (a rank-slice output carries its own cut).

    ``graph_decode``: True decodes through a GraphDecoder (static KV cache of ``graph_slots`` rows
    x ``graph_max_len`` tokens, CUDA graphs) where that works -- CUDA, TP=1, GQA -- and eagerly
    elsewhere (logged); "force" takes the static path on the CPU too (no graphs; for tests).
    """
    if graph_decode not in (True, False, "force"):
        raise UsageError(f"graph_decode must be True, False or 'force', got {graph_decode!r}")
    backend = resolve_backend(backend, device)
    env = _torchrun_env()
    if env is not None:
        rank, world = env
        if tp not in (1, world):
            raise UsageError(f"--tp {tp} but torchrun started {world} processes")
    else:
        rank, world = 0, int(tp)
    if world < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    layout = resolve(path, world)          # names only: a wrong --tp fails here, before any spawn
    trace = os.environ.get("EXL3TOOLS_TRACE_OPENS") == "1"
    opts = dict(backend=backend, device=device, max_context=max_context, moe=moe, trace=trace)
    if env is not None and rank != 0:
        serve_rank(str(path), rank=rank, world=world, port=None, **opts)
        return None
    procs = []
    if world > 1:
        port = None
        if env is None:
            port = D.free_port()
            procs = D.spawn_workers(world, port, str(path), {**opts, "threads": torch.get_num_threads()
                                                              // world or 1})
    try:
        if world > 1:
            D.init_group(0, world, rank_device(device, 0, world), port, procs)
        if trace:
            D.trace_opens_start()
        err, model = None, None
        try:
            model = build_local_model(layout, 0, world, backend=backend, device=device, max_context=max_context,
                                      moe=moe)
        except Exl3Error as exc:
            err = exc
            if world == 1:
                raise
        opened = {0: D.trace_opens_stop()} if trace else {}
        if world > 1:
            status = D.exchange_status(err, opened.get(0))
            opened = {st["rank"]: st["opened"] for st in status} if trace else {}
    except BaseException:
        if world > 1:
            D.destroy()
            _reap(procs, wait=5.0)
        raise
    name = layout.root.name if layout.root.name not in ("model",) else layout.root.parent.name
    runner = Runner(model, layout.rank_dir(0), name, world=world, procs=procs,
                    max_cache_tokens=max_cache_tokens, opened=opened,
                    graph_slots=graph_slots if graph_decode else 0, graph_max_len=graph_max_len,
                    graph_force=graph_decode == "force")
    if world > 1:
        atexit.register(runner.close)
    if model is None:  # pragma: no cover - exchange_status raised already
        raise CheckpointError("model failed to load")
    return runner
