"""Chat templates: the model's Jinja template rendered in a sandbox, as transformers does."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from exl3tools.server.api_errors import APIError, bad_request


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False, **_: json.dumps(
            v, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}
        # OpenAI's "developer" role replaced "system": a template that never names it would print it
        # as an unknown role (or refuse it), so it renders as "system" there
        self._developer = "developer" in source

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        if not self._developer:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        context = {**kwargs, **self._specials, "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except _TemplateRefusal as exc:
            raise bad_request(f"chat template: {exc}", param="messages") from None
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise bad_request(f"chat template could not render these messages: {exc}",
                              param="messages", code="template_error") from None


class _TemplateRefusal(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateRefusal(message)


def no_template() -> APIError:
    return bad_request("this model has no chat template; use /v1/completions", param="messages",
                       code="no_chat_template")
