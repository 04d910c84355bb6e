"""Thin routes: parse and validate, tokenise, hand to the engine, shape the answer.

Every error leaves in the OpenAI shape with a string code; tracebacks go to the log only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from exl3tools.errors import NotFoundError
from exl3tools.plan import DEFAULT_MAX_NUM_SEQS
from exl3tools.server import anthropic_messages, detok, openai_responses, reasoning, tokenization, tools
from exl3tools.server.anthropic_messages import CountTokensRequest, MessagesRequest
from exl3tools.server.detok import TokenText
from exl3tools.server.engine import RETRY_AFTER_S, Engine, not_ready
from exl3tools.server.gate import Gate, error_response
from exl3tools.server.limits import PromptGuard, check_api_keys
from exl3tools.server.metrics import Metrics
from exl3tools.server.openai_responses import ResponsesRequest
from exl3tools.server.protocol import (
    MAX_BODY_BYTES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Prepared,
    SamplingParams,
    bad_request,
    check_chat_extras,
    check_completion_extras,
    completion_prompts,
    error_body,
    message_dicts,
    parse_body,
    sampling_params,
)
from exl3tools.server.reasoning import ThinkSplitter
from exl3tools.server.responses import ChatStream, Choice, EventStream, Formatter
from exl3tools.server.structured import Constraint, output_constraint
from exl3tools.server.template import ChatTemplate, no_template
from exl3tools.text import first_line

log = logging.getLogger("exl3tools.serve")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
PING_INTERVAL_S = 15.0


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model_path: str | None = None
    # --served-model-name: one name or several (the first is reported, every one is accepted)
    served_model_name: str | tuple[str, ...] | None = None
    tp: int = 1
    moe: str = "tp"  # how an unsliced checkpoint's experts are cut over --tp ranks: "tp" | "ep"
    device: str = "cpu"
    backend: str = "auto"
    api_keys: tuple[str, ...] = ()
    max_batch: int = DEFAULT_MAX_NUM_SEQS   # --max-num-seqs
    max_queue: int = 256
    max_cache_tokens: int | None = None  # KV cache size in tokens; None: from the memory budget (CUDA)
    max_prefill_tokens: int = 512
    max_context: int | None = None  # --max-model-len: cap the model's context (default: config.json)
    cpu_threads: int | None = None  # None: all cores but one, which the event loop keeps
    # decode steps (runtime/paged_decode.py): None = CUDA graphs per batch bucket on a CUDA device,
    # eager on the CPU; True = graphs; False = eager; "force" = the fixed-shape step without graphs
    cuda_graphs: bool | str | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    prefix_caching: bool = True
    speculative_tokens: int = 0   # MTP drafts per decode step (0: off)
    prefill_wait_s: float = 0.0   # idle engine: gather a burst of requests this long into one prefill
    reasoning_parser: str = "none"   # "none", or <think> tags apart (server/reasoning.py PARSERS)
    chat_template: str | None = None  # --chat-template's text: replaces the checkpoint's
    generation_config: str = "auto"   # "auto": generation_config.json's request defaults; "vllm": none
    seed: int | None = None           # --seed: requests without a seed draw theirs from it, in order
    # CORS (Starlette's CORSMiddleware) only when origins are given: else no CORS headers at all
    allowed_origins: tuple[str, ...] | None = None
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class LoadCount:
    """Weights read so far (runtime.weights.progress_hook, as the terminal's bar), for /health."""

    def __init__(self) -> None:
        self.bytes = self.total = self.tensors = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int, total: int) -> None:
        with self._lock:
            self.bytes, self.total, self.tensors = self.bytes + nbytes, total, self.tensors + 1

    def body(self) -> dict[str, Any]:
        total = self.total or None     # unknown before the first tensor (e.g. a hub download)
        return {"loaded_bytes": self.bytes, "total_bytes": total, "tensors_loaded": self.tensors,
                "fraction": min(self.bytes / total, 1.0) if total else None}


def runtime_loader(cfg: ServeConfig, progress: Callable[[int, int], None] | None = None) -> Callable[[], Any]:
    """The runner factory: everything device-related stays in exl3tools.runtime. ``progress(bytes
    read, total)`` after each tensor read, besides the hook already set (the CLI's bar)."""
    def load() -> Any:
        runner = _counted()
        defaults = getattr(runner, "generation_defaults", None)
        if cfg.generation_config == "auto" and defaults:   # vLLM warns alike: they change every such request
            log.info("generation_config.json gives requests that leave them out these defaults: %s "
                     "(--generation-config vllm ignores them)", defaults)
        return runner

    def _counted() -> Any:
        if progress is None:
            return _load()
        from exl3tools.runtime import weights

        prev = weights.progress_hook

        def hook(nbytes: int, total: int) -> None:
            progress(nbytes, total)
            if prev is not None:
                prev(nbytes, total)
        weights.progress_hook = hook
        try:
            return _load()
        finally:
            if weights.progress_hook is hook:
                weights.progress_hook = prev

    def _load() -> Any:
        from exl3tools.runtime.runner import load_runner

        kwargs: dict[str, Any] = {"device": cfg.device, "tp": cfg.tp, "backend": cfg.backend}
        if cfg.tp > 1:
            kwargs["moe"] = cfg.moe
        if cfg.max_cache_tokens is not None:
            kwargs["max_cache_tokens"] = cfg.max_cache_tokens
        if cfg.max_context is not None:
            kwargs["max_context"] = cfg.max_context
        decode = {None: None, True: "graphs", False: "eager", "force": "static"}[cfg.cuda_graphs]
        kwargs.update(decode=decode, max_num_seqs=cfg.max_batch, block_size=cfg.block_size,
                      kv_dtype=cfg.kv_cache_dtype, gpu_memory_utilization=cfg.gpu_memory_utilization,
                      prefix_caching=cfg.prefix_caching, max_num_batched_tokens=prefill_tokens(cfg))
        if cfg.speculative_tokens:
            kwargs["speculative_tokens"] = cfg.speculative_tokens
        if cfg.device == "cpu":
            _cpu_threads(cfg.cpu_threads)
        return load_runner(local_path(cfg.model_path, cfg.tp, cfg.moe), **kwargs)
    return load


def prefill_tokens(cfg: ServeConfig) -> int:
    """The prompt tokens a step may take, for the engine and the runner alike (batch-invariant runs
    cap it so that every step fits the fixed-shape step: runtime/invariance.py)."""
    from exl3tools.runtime import invariance

    return invariance.prefill_tokens(cfg.max_prefill_tokens, cfg.max_batch)


def local_path(spec: str, tp: int = 1, moe: str = "tp") -> str:
    """A local checkpoint path as is; a hub repo id (``owner/name[@rev]``) downloaded to the hub
    cache first, or with ``tp`` > 1 rank-sliced straight from the hub into the cache, fetching only
    the byte ranges of ranks not there yet (this runs while /health says 503 loading)."""
    from exl3tools.hub import looks_like_repo_id, split_revision

    if Path(spec).exists() or not looks_like_repo_id(spec):
        return spec
    if tp > 1:
        from exl3tools.hub_slice import ensure_slices

        log.info("rank-slicing %s for --tp %d from the Hugging Face hub (or its local cache)", spec, tp)
        return str(ensure_slices(spec, tp, moe))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, rev = split_revision(spec)
    log.info("fetching %s from the Hugging Face hub (or its local cache)", spec)
    try:
        return snapshot_download(repo, revision=rev)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise NotFoundError(f"{spec}: not a local path, and the hub gave no checkpoint ({first_line(exc)})") from None


def _cpu_threads(n: int | None) -> None:
    """Leave a core to the event loop: with every core in torch's pool, a busy HTTP thread stalls
    each parallel region at its barrier (measured: 64 streams on 2 cores, 7x slower steps)."""
    import torch

    torch.set_num_threads(n or max(1, (os.cpu_count() or 2) - 1))


def runtime_hooks() -> dict[str, Callable]:
    from exl3tools.runtime import sampling

    return {"sample": sampling.sample, "sample_batch": sampling.sample_batch,
            "sample_device": sampling.sample_device,
            "make_adjust": sampling.Adjust, "adjust_rows": sampling.adjust_rows,
            "accept_drafts": sampling.accept_drafts,
            "logprobs": sampling.logprobs, "make_generator": sampling.make_generator}


class Server:
    """State shared by the routes: config, engine, metrics, the chat template."""

    def __init__(self, cfg: ServeConfig, load: Callable[[], Any], hooks: dict[str, Callable]) -> None:
        self.cfg = cfg
        names = cfg.served_model_name
        self.served_names: tuple[str, ...] = (names,) if isinstance(names, str) else tuple(names or ())
        self.metrics = Metrics(self.served_names[0] if self.served_names else _path_name(cfg.model_path))
        self._seeds = random.Random(cfg.seed) if cfg.seed is not None else None
        self.engine = Engine(load, max_batch=cfg.max_batch, max_queue=cfg.max_queue,
                             max_prefill_tokens=prefill_tokens(cfg), metrics=self.metrics,
                             prefill_wait_s=cfg.prefill_wait_s, **hooks)
        self.metrics.bind(self.engine)
        self._template: ChatTemplate | None = None
        self._template_checked = False
        self._token_text: TokenText | None = None
        self._guard: PromptGuard | None = None
        self._grammars: Any = None             # server/structured.Grammars, on the first response_format
        self._grammars_lock = threading.Lock()
        self._detok: dict[frozenset, Any] = {}   # markers -> the tokenizer that keeps them as text

    def guard(self) -> PromptGuard:
        """Prompt-size checks that run before any tokenization (server/limits.py)."""
        if self._guard is None:
            self._guard = PromptGuard.for_runner(self.runner, self.engine.cache_budget)
        return self._guard

    def grammars(self) -> Any:
        """The tokenizer in llguidance's form (structured outputs), built once (~10 ms to ~1 s)."""
        with self._grammars_lock:
            if self._grammars is None:
                from exl3tools.server.structured import Grammars

                r = self.runner
                if r.tokenizer is None:
                    raise bad_request("structured outputs need the checkpoint's tokenizer.json", param="response_format")
                # the larger of the two vocabularies: ids past the model's are masked by Adjust's trim
                vocab = max(r.vocab_size, r.tokenizer.get_vocab_size(with_added_tokens=True))
                self._grammars = Grammars(r.tokenizer.to_str(), sorted(r.eos_token_ids), vocab)
            return self._grammars

    def detokenizer(self, markers: frozenset[str]) -> Any:
        """The tokenizer that decodes answers with ``markers`` (what a parser reads) as text; None
        where the runner's already does (none of them is a special token)."""
        if not markers:
            return None
        if markers not in self._detok:
            tok = self.runner.tokenizer
            kept = detok.keeping(tok, markers)
            self._detok[markers] = None if kept is tok else kept
        return self._detok[markers]

    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.runner.tokenizer)
        return self._token_text

    @property
    def runner(self) -> Any:
        if self.engine.state != "ready":
            raise not_ready(self.engine)
        return self.engine.runner

    @property
    def model_name(self) -> str:
        """The name answers report: --served-model-name's first, else the checkpoint's."""
        if self.served_names:
            return self.served_names[0]
        spec = self.cfg.model_path or ""
        from exl3tools.hub import looks_like_repo_id, split_revision

        if not Path(spec).exists() and looks_like_repo_id(spec):
            return split_revision(spec)[0]  # not the snapshot hash the cache dir is named after
        return self.runner.model_name

    def model_names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may give (vLLM: all of --served-model-name)."""
        return self.served_names or (self.model_name,)

    def check_model(self, name: str) -> None:
        if name not in self.model_names():
            served = "', '".join(self.model_names())
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"'{served}'", param="model", code="model_not_found")

    def defaults(self) -> dict[str, Any]:
        """The request defaults of generation_config.json (``--generation-config auto``), or none."""
        if self.cfg.generation_config != "auto":
            return {}
        return getattr(self.runner, "generation_defaults", None) or {}

    def _with_format(self, params: SamplingParams, c: Constraint | None) -> SamplingParams:
        """The request's output constraint (response_format, structured_outputs, guided_*) as the
        answer's grammar (server/structured.py)."""
        return params if c is None else dataclasses.replace(params, grammar=self.grammars().compile(c))

    def seeded(self, params: SamplingParams) -> SamplingParams:
        """With --seed, a request without a seed gets the next of the server's seeds: drawn at
        submission (the event loop's order), so the same requests sample alike after a restart."""
        if params.seed is not None or self._seeds is None:
            return params
        return dataclasses.replace(params, seed=self._seeds.getrandbits(63))

    def template_source(self) -> str | None:
        return self.cfg.chat_template or getattr(self.runner, "chat_template", None)

    def template(self) -> ChatTemplate:
        if not self._template_checked:
            r = self.runner
            src = self.template_source()
            if src:
                self._template = ChatTemplate(src, bos_token=_special(r, "bos"),
                                              eos_token=_special(r, "eos"))
            self._template_checked = True
        if self._template is None:
            raise no_template()
        return self._template

    # ------------------------------------------------------------ request preparation

    def _limits(self, longest: int, max_tokens: int | None, default: int | None, param: str) -> int:
        """``max_tokens`` checked against the context; None: ``default`` (None: the rest of the
        context), capped by generation_config.json's max_new_tokens, and by the context."""
        runner, budget = self.runner, self.engine.cache_budget
        ctx = runner.max_context
        limit = min(ctx, budget) if budget else ctx
        if longest >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"prompt has {longest}", param=param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(x for x in (default, self.defaults().get("max_tokens"), limit - longest) if x is not None)
        if longest + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; you "
                           f"requested {longest + max_tokens} ({longest} in the prompt, "
                           f"{max_tokens} for the completion)", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        check_completion_extras(req)
        constraint = output_constraint(req)   # checked before the prompts are tokenized
        runner = self.runner
        self.token_text()  # built once, here in a worker thread: parsing a big tokenizer takes time
        texts = completion_prompts(req)
        self.guard().check_prompts(texts)  # sizes first: tokenizing megabytes stalls the server
        prompts: list[list[int]] = []
        for p in texts:
            if isinstance(p, str):
                ids = detok.encode_ids(runner.tokenizer, p, add_special_tokens=True)
            else:
                if not p:
                    raise bad_request("token prompts must not be empty", param="prompt")
                if min(p) < 0 or max(p) >= runner.vocab_size:     # (C loops: a burst parses these)
                    raise bad_request(f"prompt token ids must be in [0, {runner.vocab_size})",
                                      param="prompt")
                ids = list(p)
            if not ids:
                if runner.bos_token_id is None:
                    raise bad_request("prompt is empty", param="prompt")
                ids = [runner.bos_token_id]
            prompts.append(ids)
        max_tokens = self._limits(max(map(len, prompts)), req.max_tokens,
                                  DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
        params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, vocab_size=runner.vocab_size,
                                 defaults=self.defaults())
        params = self._with_format(params, constraint)
        extras: dict[str, Any] = {}
        if req.echo:     # the prompts' text before the completions; with logprobs, their tokens' too
            extras["echo"] = [t if isinstance(t, str) else runner.tokenizer.decode(ids, skip_special_tokens=False)
                              for t, ids in zip(texts, prompts, strict=True)]
            if req.logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        return Prepared(prompts, params, req.n, req.stream,
                        bool(req.stream_options and req.stream_options.include_usage),
                        req.return_token_ids, extras=extras)

    def prepare_chat(self, req: ChatCompletionRequest, *, limits: bool = True) -> Prepared:
        """``req`` rendered and tokenised, its sampling settled; ``limits`` False: a prompt past
        the context is not refused (count_tokens counts it)."""
        check_chat_extras(req)
        constraint = output_constraint(req)   # checked before the template renders
        runner = self.runner
        mode = tools.tool_mode(req, tools.call_syntax(self.template_source()))
        self.token_text()
        messages = message_dicts(req)
        self.guard().check_messages(messages)  # sizes first, before rendering and tokenizing
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:    # the template's thinking switch, unless the request set it
            switch = reasoning.template_switch(reasoning.EFFORTS[req.reasoning_effort])
            for k, v in {**switch, "reasoning_effort": req.reasoning_effort}.items():
                kwargs.setdefault(k, v)
        if req.tools:
            kwargs["tools"] = tools.template_tools(req)
        text = self.template().render(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
        self.guard().check_text(len(text), "messages")
        ids = detok.encode_ids(runner.tokenizer, text, add_special_tokens=False)
        if not ids:
            raise bad_request("the chat template rendered an empty prompt", param="messages")
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._limits(len(ids), wanted, None, "messages") if limits else wanted or 1
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, vocab_size=runner.vocab_size,
                                 defaults=self.defaults())
        params = self._with_format(params, constraint)
        if mode.forced is not None:                    # a call the answer must be (server/tools.py)
            params = dataclasses.replace(params, grammar=self.grammars().schema(tools.call_schema(mode.forced), "tools"))
        thinks = self.cfg.reasoning_parser != "none"
        opened = thinks and reasoning.opens_inside(text)   # the answer starts inside the thinking
        if thinks and params.grammar is not None:
            # a grammar holds what follows the thinking where the tags are single tokens, else the
            # whole answer (which then has no thinking to split off)
            gate = reasoning.think_gate(runner.tokenizer, opened)
            thinks = gate is not None
            if thinks:
                params = dataclasses.replace(params, think_gate=gate)
        markers = (mode.syntax.markers if mode.syntax is not None else frozenset()) | (
            frozenset({reasoning.OPEN, reasoning.CLOSE}) if thinks else frozenset())
        return Prepared([ids], params, req.n, req.stream,
                        bool(req.stream_options and req.stream_options.include_usage),
                        req.return_token_ids,
                        extras={"calls": mode if mode.forced is not None or mode.syntax is not None else None,
                                "think": opened if thinks else None,
                                "detok": self.detokenizer(markers)})


def _path_name(spec: str | None) -> str:
    p = Path(spec or "model")
    return p.parent.name if p.name == "model" and p.parent.name else p.name


def _special(runner: Any, which: str) -> str:
    """bos/eos token text for templates that print them: Runner.bos_token / eos_token."""
    text = getattr(runner, f"{which}_token", None)
    return text if isinstance(text, str) else ""


# ---------------------------------------------------------------------- the app


def create_app(cfg: ServeConfig, *, load: Callable[[], Any] | None = None,
               hooks: dict[str, Callable] | None = None) -> FastAPI:
    check_api_keys(cfg.api_keys)  # an empty key would admit every blank x-api-key header
    loaded = LoadCount()   # /health's progress (a ``load`` of the caller's reports none)
    server = Server(cfg, load or runtime_loader(cfg, loaded.add), hooks or runtime_hooks())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        await run_in_threadpool(server.engine.stop)

    app = FastAPI(title="exl3tools serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, kind),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("internal server error; see the server log", "server_error",
                                       None, "internal_error"), status_code=500)

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])     # vLLM's (and SageMaker's) name for it
    async def health() -> Response:
        eng = server.engine
        if eng.state == "ready":
            return JSONResponse({"status": "ok", "model": server.model_name})
        body = error_body(not_ready(eng).message, "server_error", None,
                          "model_loading" if eng.state == "loading" else "model_load_failed")
        body["status"] = eng.state
        body["elapsed_s"] = round(time.monotonic() - eng.load_started, 1)
        if eng.state == "loading":
            body.update(loaded.body())
        headers = {"Retry-After": str(RETRY_AFTER_S)} if eng.state == "loading" else {}
        return JSONResponse(body, status_code=503, headers=headers)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from exl3tools import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": _STARTED,
                "owned_by": "exl3tools", "max_model_len": server.runner.max_context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in server.model_names()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        server.check_model(name)
        return model_card(name)

    @app.get("/v1/engine/stats")
    async def engine_stats() -> dict[str, Any]:
        return server.engine.stats()

    @app.get("/v1/engine/steps")
    async def engine_steps() -> dict[str, Any]:
        # the engine's recent steps (Engine.recent_steps), times on this host's time.monotonic()
        return {"now": time.monotonic(), "steps": server.engine.recent_steps()}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        received = time.monotonic()
        req = await run_in_threadpool(parse_body, await _read_body(request), CompletionRequest)  # off the loop
        return await _generate(request, req, chat=False, received=received)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        received = time.monotonic()
        req = await run_in_threadpool(parse_body, await _read_body(request), ChatCompletionRequest)  # off the loop
        return await _generate(request, req, chat=True, received=received)

    @app.post("/v1/messages")
    async def messages_api(request: Request) -> Response:
        received = time.monotonic()
        req = await run_in_threadpool(parse_body, await _read_body(request), MessagesRequest)  # off the loop
        return await _generate(request, anthropic_messages.to_chat(req), chat=True, received=received, messages=True)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        req = await run_in_threadpool(parse_body, await _read_body(request), CountTokensRequest)
        server.runner  # noqa: B018 -- 503 while loading
        server.check_model(req.model)
        prep = await run_in_threadpool(functools.partial(server.prepare_chat, limits=False), anthropic_messages.to_chat(req))
        return {"input_tokens": len(prep.prompts[0])}

    @app.post("/tokenize")
    async def tokenize_api(request: Request) -> dict:
        req = await run_in_threadpool(parse_body, await _read_body(request), tokenization.TokenizeRequest)
        return await run_in_threadpool(tokenization.tokenize, server, req)

    @app.post("/detokenize")
    async def detokenize_api(request: Request) -> dict:
        req = await run_in_threadpool(parse_body, await _read_body(request), tokenization.DetokenizeRequest)
        return await run_in_threadpool(tokenization.detokenize, server, req)

    @app.post("/v1/responses")
    async def responses_api(request: Request) -> Response:
        received = time.monotonic()
        req = await run_in_threadpool(parse_body, await _read_body(request), ResponsesRequest)  # off the loop
        return await _generate(request, openai_responses.to_chat(req), chat=True, received=received, responses=req)

    async def _generate(request: Request, req: Any, *, chat: bool, received: float,
                        responses: ResponsesRequest | None = None, messages: bool = False) -> Response:
        """A completion or chat completion; ``responses``: the Responses API request ``req`` (a
        chat request) came from, whose answer and stream take its shape (server/openai_responses.py);
        ``messages``: likewise from Anthropic's Messages API (server/anthropic_messages.py)."""
        server.runner  # noqa: B018 -- 503 while loading, before anything else
        server.check_model(req.model)
        prep = await run_in_threadpool(server.prepare_chat if chat else server.prepare_completion, req)
        eng = server.engine
        prep.params = server.seeded(prep.params)
        handle = eng.submit(asyncio.get_running_loop(), prep.prompts, prep.params, prep.n, received,
                            tokenizer=prep.extras.get("detok"))
        server.metrics.prompt_tokens.inc(handle.prompt_tokens)
        fmt = Formatter(chat=chat, rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                        created=int(time.time()), model=server.model_name,
                        tokens=server.token_text(), logprobs=prep.params.logprobs is not None,
                        token_ids=prep.return_token_ids,
                        calls=tools.CallReader(prep.extras["calls"]) if prep.extras.get("calls") else None,
                        think=ThinkSplitter(prep.extras["think"]) if prep.extras.get("think") is not None else None,
                        echo=prep.extras.get("echo"), n=prep.n)
        rid = (openai_responses.new_id("resp") if responses is not None else anthropic_messages.new_id() if messages
               else fmt.rid)
        if prep.stream:
            if responses is not None:
                stream = EventStream(fmt, openai_responses.EventWriter(responses, rid, fmt.created, fmt.model))
            elif messages:
                stream = EventStream(fmt, anthropic_messages.EventWriter(rid, fmt.model, handle.prompt_tokens))
            else:
                stream = ChatStream(fmt, prep.include_usage)
            return StreamingResponse(_stream(handle, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Request-Id": rid})
        body = await _collect(request, handle, fmt)
        if responses is not None:
            body = openai_responses.from_chat(body, responses, rid)
        elif messages:
            body = anthropic_messages.from_chat(body, rid)
        return JSONResponse(body, headers={"X-Request-Id": rid})

    async def _collect(request: Request, handle: Any, fmt: Formatter) -> dict:
        task = asyncio.current_task()

        async def watch() -> None:  # the body is read, so the next message is the disconnect
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    handle.cancel()
                    task.cancel()
                    return

        watcher = asyncio.create_task(watch())
        choices: dict[int, Choice] = {}
        try:
            async for evs in handle.events():
                for ev in evs:
                    if ev.error is not None:
                        raise ev.error
                    c = choices.setdefault(ev.index, Choice(ev.index))
                    c.text.append(ev.text)
                    c.token_ids.extend(ev.token_ids)
                    if ev.prompt_logprobs:
                        c.prompt_logprobs = ev.prompt_logprobs
                    if ev.logprobs:
                        c.logprobs.extend(ev.logprobs)
                    if ev.finish_reason:
                        c.finish_reason, c.stop_reason = ev.finish_reason, ev.stop_reason
        finally:
            watcher.cancel()
            handle.cancel()
        server.metrics.e2e.observe(time.monotonic() - handle.t_arrival)
        return fmt.response(list(choices.values()), handle.prompt_tokens, handle.completion_tokens,
                            handle.cached_tokens, (handle.accepted_tokens, handle.rejected_tokens))

    async def _stream(handle: Any, stream: ChatStream | EventStream):
        """``handle``'s events as ``stream``'s server-sent text (everything ready in one write)."""
        try:
            head = stream.start()
            if head:
                yield head
            async for evs in handle.events(ping=PING_INTERVAL_S):
                if not evs:
                    yield ": ping\n\n"
                    continue
                out = []
                for ev in evs:
                    if ev.error is not None:
                        yield "".join(out) + stream.error(ev.error)
                        return
                    out.append(stream.feed(ev))
                yield "".join(out)
            server.metrics.e2e.observe(time.monotonic() - handle.t_arrival)
            yield stream.end(handle)
        finally:  # client gone (task cancelled) or done: either way the engine lets go
            handle.cancel()

    app.add_middleware(Gate, server=server)
    if cfg.allowed_origins is not None:
        from starlette.middleware.cors import CORSMiddleware

        # added last, so outermost: it answers a browser's preflight (which carries no key) before
        # the Gate, and its headers reach the Gate's 401s too
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                           allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
                           allow_credentials=cfg.allow_credentials)
    return app


_STARTED = int(time.time())


async def _read_body(request: Request) -> bytes:
    """The body, refusing more than MAX_BODY_BYTES before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
