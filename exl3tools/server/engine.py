"""The engine: one thread owns the runner; continuous batching between steps.

Each step: drop cancelled sequences (freeing their cache), admit waiting sequences while the batch
and the KV-cache budget allow, run one ``runner.step`` over a mix of prefill chunks and decode
tokens, sample each sequence that produced a token (on the logits' device), and free the cache of
every sequence that finished. When the next step is certain to decode the same sequences, it is
chained: launched on the sampled tokens before the host reads them (``_chain``), so the GPU runs
step N+1 while the host emits step N. Results go to the event loop through
``loop.call_soon_threadsafe``, so the loop never blocks on the model. The engine never touches a
device: the runner and ``runtime.sampling`` do.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from exl3tools.errors import Exl3Error, RuntimeFailure
from exl3tools.plan import DEFAULT_MAX_NUM_SEQS
from exl3tools.runtime import preview
from exl3tools.server.api_errors import APIError
from exl3tools.server.detok import TextTracker
from exl3tools.server.engine_sampling import TokenSampling
from exl3tools.server.engine_scoring import PromptScoring
from exl3tools.server.engine_spec import SpeculativeRounds
from exl3tools.server.planner import graph_limits, plan_step
from exl3tools.server.requests import Event, RequestHandle, Sequence, deliver
from exl3tools.server.sampling_params import SamplingParams
from exl3tools.text import first_line

log = logging.getLogger("exl3tools.serve")

RETRY_AFTER_S = 1
TRACE_STEPS = 512     # the last steps kept for /v1/engine/steps
BANDWIDTH_STEPS = 64  # decode steps behind the achieved weight-read GB/s (a median)


class _Inflight:
    """A launched step: the rows that produce a token ((row, sequence)), the device logits and
    the device tokens sampled from them (None: sampled when read)."""

    __slots__ = ("ready", "logits", "tokens")

    def __init__(self, ready: list, logits: Any, tokens: Any) -> None:
        self.ready, self.logits, self.tokens = ready, logits, tokens


class Engine(TokenSampling, SpeculativeRounds, PromptScoring):
    def __init__(self, load: Callable[[], Any], *, max_batch: int = DEFAULT_MAX_NUM_SEQS, max_queue: int = 256,
                 max_prefill_tokens: int = 512, metrics: Any = None,
                 sample: Callable | None = None, logprobs: Callable | None = None,
                 make_generator: Callable | None = None, sample_batch: Callable | None = None,
                 sample_device: Callable | None = None, chain: bool = True,
                 make_adjust: Callable | None = None, adjust_rows: Callable | None = None,
                 accept_drafts: Callable | None = None, prefill_wait_s: float = 0.0) -> None:
        self._load = load
        self.max_batch, self.max_queue = max_batch, max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.prompt_fit = preview.switched_on("prompt_fit")     # (_plan)
        self.prefill_wait_s = prefill_wait_s   # --prefill-wait-ms: an idle engine gathers a burst
        self.metrics = metrics
        self._sample_fn, self._logprobs_fn, self._make_gen = sample, logprobs, make_generator
        self._sample_batch_fn = sample_batch  # None: one sample() call per row
        # tokens left on the device (runtime.sampling.sample_device -> DeviceTokens): with ``chain``,
        # a decode step's samples feed the next step before the host reads them (see _chain)
        self._sample_device_fn = sample_device
        self._make_adjust, self._adjust_rows = make_adjust, adjust_rows   # runtime.sampling.Adjust
        self._accept_fn = accept_drafts      # speculative decoding's verdict (runtime.sampling)
        self.spec_drafted = self.spec_accepted = 0
        self.chain = chain
        self._inflight: _Inflight | None = None
        self.runner: Any = None
        self.state = "loading"  # loading -> ready | failed
        self.load_error: str | None = None
        self.load_exception: BaseException | None = None
        self.on_state: Callable[[str], None] | None = None  # called once: "ready" or "failed"
        self.load_started = time.monotonic()
        self.cache_budget = 0
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._outbox: list[tuple[RequestHandle, Event]] = []
        self._ids = itertools.count(1)
        self._stop = False
        self._drain_at: float | None = None    # drain(): when requests in flight are ended
        self._thread = threading.Thread(target=self._main, name="exl3tools-engine", daemon=True)
        self.steps = 0
        self.time_forward = 0.0  # seconds in runner.step, and in sampling + bookkeeping
        self.time_sample = 0.0
        self.cancelled_total = 0
        self.preempted_total = 0
        # the last TRACE_STEPS steps: when each ran, what it held, which path took it, and the
        # (received, queued) times of the sequences it admitted (a burst's schedule, read back)
        self.trace: deque[dict[str, Any]] = deque(maxlen=TRACE_STEPS)
        self._admitted: list[tuple[float, float]] = []
        # achieved weight-read bandwidth of decode steps (serving-expectations.md §8): the runner's
        # roofline.DecodeReads, the last decode step's estimated bytes and recent steps' GB/s
        self.decode_reads: Any = None
        self.decode_bytes = 0
        self._decode_gbps: deque[float] = deque(maxlen=BANDWIDTH_STEPS)

    # ----------------------------------------------------------------- event loop side

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def drain(self, timeout: float) -> None:
        """The server is shutting down: refuse new requests (503) and give those in flight
        ``timeout`` seconds to finish; then each ends with a 503 error event (its stream closes in
        its own API's shape) rather than having its connection cut."""
        with self._cond:
            if self._drain_at is None:
                self._drain_at = time.monotonic() + max(0.0, timeout)
            self._cond.notify_all()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def cache_tokens_used(self) -> int:
        r = self.runner
        return max(0, self.cache_budget - r.cache_tokens_free()) if r is not None else 0

    def prefix_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found there) since start."""
        r = self.runner
        if r is None or not hasattr(r, "prefix_stats"):
            return 0, 0
        st = r.prefix_stats()
        return st.queried_tokens, st.hit_tokens

    def submit(self, loop: Any, prompts: list[list[int]], params: SamplingParams, n: int,
               received: float | None = None, tokenizer: Any = None) -> RequestHandle:
        """Queue prompts x n choices; 429 when the queue is full, 503 while not ready.
        ``received``: time.monotonic() when the request reached the server (default: now);
        ``tokenizer``: the answers' detokenizer (default the runner's; detok.keeping)."""
        if self.state != "ready":
            raise not_ready(self)
        if self._drain_at is not None:
            raise shutting_down()
        seqs_needed = len(prompts) * n
        if seqs_needed > self.max_queue:
            raise APIError(400, f"this request asks for {seqs_needed} sequences (prompts x n); the "
                           f"server queues at most {self.max_queue} (--max-queue)",
                           param="n" if n > 1 else "prompt", code="too_many_sequences")
        handle = RequestHandle(self, loop, seqs_needed, sum(len(p) for p in prompts), received, n)  # once, not x n
        tok = tokenizer or self.runner.tokenizer
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        with self._cond:
            if self._waiting and len(self._waiting) + seqs_needed > self.max_queue:
                raise APIError(429, f"the server is busy ({len(self._waiting)} sequences queued); "
                               "retry later", type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            for p_i, prompt in enumerate(prompts):
                for j in range(n):
                    index = p_i * n + j
                    seq = Sequence(next(self._ids), index, prompt, params, handle,
                                   TextTracker(tok, params.stop))
                    seq.generator = (seed + index) % 2**64  # a seed until the first sample
                    handle.seqs.append(seq)
                    self._waiting.append(seq)
            self._cond.notify_all()
        return handle

    # ----------------------------------------------------------------- engine thread

    def _main(self) -> None:
        try:
            runner = self._load()
            self._warmup(runner)
        except BaseException as exc:  # reported by /health (and `exl3tools serve` exits)
            if isinstance(exc, Exl3Error):
                log.error("model load failed: %s", exc)
            else:
                log.exception("model load failed")
            self.load_exception = exc
            self.load_error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"
            if self.on_state is not None:
                self.on_state("failed")
            return
        self.runner = runner
        if hasattr(runner, "on_lost"):      # a tensor-parallel rank exiting wakes an idle engine
            runner.on_lost = self.wake
        self.cache_budget = runner.cache_tokens_free()
        self.decode_reads = _decode_reads(runner)
        self.state = "ready"
        if self.on_state is not None:
            self.on_state("ready")
        log.info("engine ready: %s, cache budget %d tokens", runner.model_name, self.cache_budget)
        prof_path = os.environ.get("EXL3TOOLS_PROFILE_ENGINE")   # cProfile of this thread (bench/gpu_serve.py)
        prof = None
        if prof_path:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        try:
            self._loop()
        except BaseException as exc:  # the engine cannot go on: say so, and release every client
            if isinstance(exc, Exl3Error):  # a known cause (a lost tensor-parallel rank): one line
                log.error("engine stopped: %s", exc)
            else:
                log.exception("engine died")
            self.load_error = f"engine stopped: {type(exc).__name__}: {exc}"
            self.load_exception = RuntimeFailure(self.load_error)
            self.state = "failed"
            if self.on_state is not None:
                self.on_state("failed")
            with self._cond:
                waiting, self._waiting = list(self._waiting), deque()
            for seq in waiting + self._running:
                self._fail(seq)
            self._flush()
        finally:
            if prof is not None:
                prof.disable()
                prof.dump_stats(prof_path)
        for seq in list(self._running):
            self._free(seq)
        close = getattr(runner, "close", None)
        if close is not None:
            try:
                close()  # with tp > 1 this stops the worker ranks
            except Exception:
                log.exception("runner.close failed")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._running and not self._lost():
                    self._cond.wait()
                if self._stop:
                    break
                if self._drain_at is not None and time.monotonic() >= self._drain_at:
                    self._end_all(shutting_down())
                if self._lost():
                    raise RuntimeFailure(self._lost())
                if self.prefill_wait_s > 0 and not self._running and self._inflight is None:
                    self._gather()
                    if self._stop:
                        break
            try:
                if not self._step():  # nothing could run (e.g. the queue head does not fit)
                    with self._cond:
                        self._cond.wait(0.01)
            except Exception:  # a bug here must not kill the engine: fail the batch, go on
                log.exception("engine step failed")
                self._inflight = None
                for seq in list(self._running):
                    self._fail(seq)
                self._sweep()
            self._flush()
            if self._lost():    # a tensor-parallel rank is gone: no later step can work, so stop
                raise RuntimeFailure(self._lost())  # (/health 503, `serve` exits 4), not fail every request

    def _lost(self) -> str | None:
        """Why the runner's tensor-parallel group is gone (Runner.lost), or None."""
        return getattr(self.runner, "lost", None)

    def _gather(self) -> None:
        """Idle, with requests waiting (the lock held): wait until ``prefill_wait_s`` after the
        oldest one arrived, or a full batch, for the rest of a burst, so that its prompts prefill in
        one step instead of the first alone and the others a step later. Nothing running waits."""
        end = self._waiting[0].handle.t_arrival + self.prefill_wait_s
        while not self._stop and len(self._waiting) < self.max_batch:
            left = end - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)

    def _warmup(self, runner: Any) -> None:
        """The first forward pass must succeed before /health says ready."""
        seq_id = -1
        runner.add_sequence(seq_id)
        try:
            first = runner.bos_token_id if runner.bos_token_id is not None else 0
            runner.step([(seq_id, [first])])
        finally:
            runner.free_sequence(seq_id)

    def _step(self) -> bool:
        """One scheduling round and forward pass; False when there was nothing to run.

        A step in flight (launched, its tokens still on the device) is either planned here or was
        chained by the previous round. Before reading its tokens, ``_chain`` may launch the next
        decode step on them, so the GPU works while the host emits this step's tokens."""
        self._reap_cancelled()
        self._admit()
        fl = self._inflight
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"t": time.monotonic(), "path": "chained"}
        spec: list = []
        if fl is None:
            if not self._running:
                return False
            batch, spec = self._split_spec(self._plan())
            # out of blocks: the newest running sequence (in this batch or holding blocks mid-prefill)
            # gives its cache back, until the step fits or one sequence is left
            while len(self._running) > 1 and not self.runner.fits(
                    [(seq.seq_id, len(c)) for seq, c in batch] + [(seq.seq_id, k + 1) for seq, k in spec]):
                self._preempt(self._running[-1])
                batch, spec = self._split_spec(self._plan())
            if spec:
                self._spec_step(spec)
            if not batch:
                self._sweep()
                if spec:
                    rec.update(path="speculative", seqs=len(spec), ms=round((time.perf_counter() - t0) * 1e3, 3))
                    self.trace.append(rec)
                return bool(spec)
            # prompts whose logprobs are wanted (completions' echo): every row's logits this step
            scored = [i for i, (seq, _) in enumerate(batch) if seq.scores_prompt and seq.num_cached < len(seq.prompt) - 1]
            try:
                # logits stay on the model's device: sampling runs there, only token ids come back
                logits = self.runner.step([(seq.seq_id, chunk) for seq, chunk in batch], device_logits=True,
                                          all_logits=bool(scored))
                if scored:
                    logits = self._score_prompts(batch, scored, logits)
            except Exception as exc:
                if self._lost():
                    log.error("runner.step failed: %s", first_line(exc))
                else:
                    log.exception("runner.step failed")
                for seq, _ in batch:
                    self._fail(seq)
                self._sweep()
                return True
            self.steps += 1
            rec.update(path=getattr(self.runner, "last_path", None), seqs=len(batch),
                       rows=sum(len(c) for _, c in batch),
                       prefill=sum(not (seq.pending == 1 and seq.output_ids) for seq, _ in batch))
            ready: list[tuple[int, Sequence]] = []
            for i, (seq, chunk) in enumerate(batch):
                seq.num_cached += len(chunk)
                if seq.num_cached >= len(seq.prompt) and not seq.finished and (
                        seq.scores_prompt or seq.params.max_tokens == 0):
                    self._end_prompt(seq)
                if seq.pending == 0 and not seq.finished:  # mid-prefill logits are not wanted
                    ready.append((i, seq))
            fl = _Inflight(ready, logits, self._launch_sample(logits, ready))
        if rec["path"] == "chained":
            rec["seqs"] = rec["rows"] = len(fl.ready)
        self._inflight = None
        nxt = self._chain(fl)
        t1 = time.perf_counter()
        if fl.ready:
            self._sample_ready(fl, nxt)
        self._inflight = nxt
        self._sweep()
        t2 = time.perf_counter()
        self.time_forward += t1 - t0
        self.time_sample += t2 - t1
        rec["ms"] = round((t2 - t0) * 1e3, 3)
        if self._admitted:
            rec["admitted"], self._admitted = self._admitted, []
        self.trace.append(rec)
        if not spec:        # (a step that also ran MTP drafts timed both)
            self._note_bandwidth(rec)
        return True

    def _note_bandwidth(self, rec: dict[str, Any]) -> None:
        """A decode-only step (no prompt rows; speculative steps never get here): its weight bytes
        at its batch size over its time (to its tokens read, sampling included, as the trace's ms)."""
        if self.decode_reads is None or rec.get("prefill") or not rec.get("seqs") or rec["ms"] <= 0:
            return
        self.decode_bytes = self.decode_reads.bytes_for(rec["seqs"])
        self._decode_gbps.append(self.decode_bytes / rec["ms"] / 1e6)

    def decode_gbps(self) -> float:
        """Median achieved weight-read GB/s of the last BANDWIDTH_STEPS decode steps (0: none yet)."""
        recent = list(self._decode_gbps)    # (appended on the engine thread)
        return statistics.median(recent) if recent else 0.0

    def _chain(self, fl: _Inflight) -> _Inflight | None:
        """Launch the next decode step on ``fl``'s device tokens, before they are read, when that
        step is certain to be the next one: every running sequence gets a token from ``fl``, none
        is waiting, cancelled, asks for logprobs or ends by length at this token (a stop token or
        string found once the tokens are read wastes the chained row, which is dropped)."""
        runner = self.runner
        if not (self.chain and fl.tokens is not None and getattr(runner, "can_chain", False)):
            return None
        if self._waiting or self._stop:
            return None
        seqs = [seq for _, seq in fl.ready if not seq.finished]
        if not seqs or len(seqs) != len(self._running) or {id(s) for s in seqs} != {id(s) for s in self._running}:
            return None
        for seq in seqs:
            p = seq.params
            n_out = len(seq.output_ids) + 1                # with this step's token
            if (p.token_by_token or seq.handle.cancelled or n_out >= p.max_tokens
                    or len(seq.prompt) + n_out >= runner.max_context):
                return None         # (processed logits need this step's token on the host first)
        if not runner.fits([(s.seq_id, 1) for s in seqs]):
            return None                                    # out of blocks: the planner preempts
        keep = None if len(seqs) == len(fl.ready) else [j for j, (_, seq) in enumerate(fl.ready) if not seq.finished]
        try:
            # a row that could not be sampled (-1) fails when read; its chained row reads token 0
            logits = runner.step_chained([s.seq_id for s in seqs], fl.tokens.rows(keep))
        except Exception:
            log.warning("chained decode step failed; planning the next step instead", exc_info=True)
            return None
        self.steps += 1
        for seq in seqs:
            seq.num_cached += 1
        ready = list(enumerate(seqs))
        return _Inflight(ready, logits, self._launch_sample(logits, ready))

    def _flush(self) -> None:
        """Hand this step's events to their event loops: one wake-up per loop, not per token."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        by_loop: dict[int, tuple[Any, list]] = {}
        for handle, ev in items:
            by_loop.setdefault(id(handle._loop), (handle._loop, []))[1].append((handle, ev))
        for loop, batch in by_loop.values():
            try:
                loop.call_soon_threadsafe(deliver, batch)
            except RuntimeError:  # loop closed: the server is shutting down
                for handle, _ in batch:
                    handle.cancelled = True

    def _plan(self) -> list[tuple[Sequence, list[int]]]:
        """This step's tokens (server/planner.py), kept within the prompt graphs unless
        EXL3TOOLS_PROMPT_FIT=0 (runtime/preview.py)."""
        return plan_step(self._running, self.max_prefill_tokens, graph_limits(self.runner) if self.prompt_fit else None)

    def _admit(self) -> None:
        """FIFO admission while the batch has room and the cache can take the sequence's pending
        tokens on top of what the running ones still need (their pending tokens and one more).
        The runner reuses cached prefix blocks: those tokens count as already computed."""
        runner, held = self.runner, None
        with self._cond:
            while self._waiting and len(self._running) < self.max_batch:
                seq = self._waiting[0]
                if seq.handle.cancelled:
                    self._waiting.popleft()
                    self._count_cancel(seq)
                    continue
                if held is None:   # the running ones' blocks once, then each admitted one's: a
                    # burst of 64 admissions was 64 x 64 lookups on the engine thread
                    held = runner.blocks_needed([(s.seq_id, s.pending + 1) for s in self._running])
                if not runner.fits([(None, seq.pending + 1)], held):
                    break  # wait for running sequences to finish and free their cache
                self._waiting.popleft()
                # a prompt being scored computes every row: no prefix-cache blocks for it
                seq.num_cached = runner.add_sequence(seq.seq_id, () if seq.scores_prompt else seq.prompt + seq.output_ids,
                                                     **self._spec_kw(seq))
                held += runner.blocks_needed([(seq.seq_id, seq.pending + 1)])
                self._admitted.append((seq.handle.t_received, seq.handle.t_arrival))
                seq.handle.note_cached(seq)
                self._running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Out of cache: the newest sequence gives its cache back and waits at the head of the
        queue; it recomputes prompt + output later and goes on with the same sampler state."""
        self._running.remove(seq)
        self._free(seq)
        seq.num_cached = 0
        with self._cond:
            self._waiting.appendleft(seq)
        self.preempted_total += 1
        if self.metrics is not None:
            self.metrics.preempted.inc()

    def _reap_cancelled(self) -> None:
        with self._cond:
            gone = [s for s in self._waiting if s.handle.cancelled]
            for s in gone:
                self._waiting.remove(s)
                self._count_cancel(s)
        for seq in [s for s in self._running if s.handle.cancelled and not s.finished]:
            seq.finished = True
            self._count_cancel(seq)
        self._sweep()

    def _count_cancel(self, seq: Sequence) -> None:
        self.cancelled_total += 1
        if self.metrics is not None:
            self.metrics.cancelled.inc()

    def _fail(self, seq: Sequence, error: APIError | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        seq.handle.push(Event(seq.index, error=error or APIError(
            500, "generation failed; see the server log", type="server_error", code="engine_error")))

    def _end_all(self, error: APIError) -> None:
        """End every waiting and running sequence with ``error`` (the lock held): the drain's
        deadline passed."""
        waiting, self._waiting = list(self._waiting), deque()
        live = [seq for seq in waiting + self._running if not seq.finished]
        for seq in live:
            self._fail(seq, error)
        if live:
            log.warning("shutting down: %d requests in flight ended (--shutdown-timeout passed)",
                        len({id(seq.handle) for seq in live}))

    def _sweep(self) -> None:
        """Free the cache of every finished sequence at once."""
        done = [s for s in self._running if s.finished]
        if done:
            self._running = [s for s in self._running if not s.finished]
            for s in done:
                self._free(s)

    def _free(self, seq: Sequence) -> None:
        try:
            self.runner.free_sequence(seq.seq_id)
        except Exception:
            log.exception("free_sequence(%s) failed", seq.seq_id)

    def recent_steps(self) -> list[dict[str, Any]]:
        """The last TRACE_STEPS steps, oldest first: ``t`` (time.monotonic() at its start), ``ms``
        (to its tokens read), ``path`` (the runner's: "decode", "prompt" or "eager" graph-less
        forward; "chained": launched on the step before), ``seqs``, ``rows``, ``prefill`` (sequences
        still in their prompt) and ``admitted``: (received, queued) monotonic times of the
        sequences it admitted."""
        return list(self.trace)

    def stats(self) -> dict[str, Any]:
        queried, hits = self.prefix_stats()
        mem = getattr(self.runner, "memory_stats", None)
        return {"memory": mem() if mem is not None else None, "state": self.state,
                # what the runner decodes with: "graphs" unless a capture failed or was turned off
                "decode_mode": getattr(self.runner, "decode_mode", None),
                "kv_cache_dtype": getattr(self.runner, "kv_cache_dtype", None),
                "queue_depth": self.queue_depth, "running": self.running,
                "cache_tokens_used": self.cache_tokens_used(), "cache_tokens_budget": self.cache_budget,
                "steps": self.steps, "cancelled_total": self.cancelled_total,
                "preempted_total": self.preempted_total,
                "prefix_cache_queried_tokens": queried, "prefix_cache_hit_tokens": hits,
                "spec_drafted_tokens": self.spec_drafted, "spec_accepted_tokens": self.spec_accepted,
                "time_forward_s": round(self.time_forward, 3), "time_sample_s": round(self.time_sample, 3),
                "decode_weight_read_bytes": self.decode_bytes,
                "decode_weight_read_gbps": round(self.decode_gbps(), 4)}


def _decode_reads(runner: Any) -> Any:
    """The runner's roofline.DecodeReads, or None (a runner without one, or headers it cannot read:
    the metric is a nicety, never a reason not to serve)."""
    fn = getattr(runner, "decode_reads", None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception as exc:   # noqa: BLE001
        log.warning("no decode weight-read estimate: %s", first_line(exc))
        return None


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")


def not_ready(engine: Engine) -> APIError:
    if engine.state == "failed":
        return APIError(503, f"the model is unavailable: {engine.load_error}", type="server_error",
                        code="model_load_failed")
    return APIError(503, "the model is still loading", type="server_error", code="model_loading",
                    headers={"Retry-After": str(RETRY_AFTER_S)})
