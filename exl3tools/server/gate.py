"""What stands before every endpoint: the API-key check and request counting (``Gate``, plain
ASGI, so streaming and disconnects stay intact), and the error body each API's clients read."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

from exl3tools.server import anthropic_messages
from exl3tools.server.api_errors import APIError

OPEN_PATHS = frozenset({"/health", "/ping", "/version"})   # vLLM keeps /ping and /version open too
# open unless --metrics-require-key: vLLM's /metrics is open, and Prometheus scrapers send no key
METRICS_PATH = "/metrics"
KNOWN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/v1/models", "/v1/completions", "/v1/responses",
                         "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                         "/tokenize", "/detokenize"})


def error_response(exc: APIError, path: str) -> JSONResponse:
    """``exc`` in the shape the clients of ``path`` read: Anthropic's under /v1/messages, else
    OpenAI's."""
    body = anthropic_messages.error_body(exc) if path.startswith("/v1/messages") else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


class Gate:
    """API-key check and request counting, as plain ASGI (keeps streaming and disconnects intact)."""

    def __init__(self, app: Any, server: Any) -> None:
        self.app, self.server = app, server
        self._keys = [k.encode() for k in server.cfg.api_keys]
        self._open = OPEN_PATHS if server.cfg.metrics_require_key else OPEN_PATHS | {METRICS_PATH}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = {"code": 500}  # what an exception before the response start amounts to

        async def send_wrapped(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self._keys and path not in self._open and not self._authorised(scope):
                resp = error_response(APIError(
                    401, "invalid or missing API key (send Authorization: Bearer <key>)",
                    type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"}), path)
                return await resp(scope, receive, send_wrapped)
            await self.app(scope, receive, send_wrapped)
        except asyncio.CancelledError:  # the client left before any answer: nginx's 499
            if status["code"] == 500:
                status["code"] = 499
            raise
        finally:
            endpoint = path if path in KNOWN_PATHS else "other"
            self.server.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()

    def _authorised(self, scope: dict) -> bool:
        got = None
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                got = value[7:].strip()
            elif name == b"x-api-key" and got is None:
                got = value.strip()
        # compare_digest against every key: no early exit that leaks which key matched
        return bool(got) and any([hmac.compare_digest(got, k) for k in self._keys])  # never a blank key
