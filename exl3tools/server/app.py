"""Thin routes: parse and validate, tokenise, hand to the engine, shape the answer.

Every error leaves in the OpenAI shape with a string code; tracebacks go to the log only. The
state the routes share and the request preparation are server/prepare.py's ``Server``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from exl3tools.server import anthropic_messages, openai_responses, tokenization, tools
from exl3tools.server.anthropic_messages import CountTokensRequest, MessagesRequest
from exl3tools.server.api_errors import APIError, error_body
from exl3tools.server.engine import RETRY_AFTER_S, not_ready
from exl3tools.server.gate import Gate, error_response
from exl3tools.server.limits import check_api_keys
from exl3tools.server.openai_responses import ResponsesRequest
from exl3tools.server.prepare import (
    LoadCount,
    ServeConfig,
    Server,
    local_path,
    prefill_tokens,
    runtime_hooks,
    runtime_loader,
)
from exl3tools.server.reasoning import ThinkSplitter
from exl3tools.server.request_body import MAX_BODY_BYTES, parse_body
from exl3tools.server.request_models import ChatCompletionRequest, CompletionRequest
from exl3tools.server.responses import ChatStream, Choice, EventStream, Formatter

# ServeConfig and the loader are imported from here by the CLI, tests and benchmarks
__all__ = ["PING_INTERVAL_S", "ServeConfig", "create_app", "local_path", "prefill_tokens", "runtime_hooks",
           "runtime_loader"]

log = logging.getLogger("exl3tools.serve")

PING_INTERVAL_S = 15.0


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
        server.metrics.e2e.observe(time.monotonic() - handle.t_received)
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
            server.metrics.e2e.observe(time.monotonic() - handle.t_received)
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
