"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt's token ids as this server would
feed them (a completion's text with the tokenizer's special tokens, or chat messages through the
chat template, tools and ``chat_template_kwargs`` included, exactly as a chat completion renders
them) and ids back to text. Clients use them to count and budget prompts, and evaluation
harnesses to build token prompts (lm-evaluation-harness, SillyTavern, vLLM's bench tools)."""

from __future__ import annotations

from typing import Any

from exl3tools.server.api_errors import APIError, bad_request
from exl3tools.server.request_body import chat_request
from exl3tools.server.request_models import ChatMessage, ToolSpec, _Request


class TokenizeRequest(_Request):
    """Either ``prompt`` (a completion's text) or ``messages`` (a chat), as vLLM takes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None   # a prompt's: default True (messages: the template's own)
    add_generation_prompt: bool = True
    tools: list[ToolSpec] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def _tokenizer(server: Any) -> Any:
    tok = server.runner.tokenizer
    if tok is None:
        raise APIError(400, "this checkpoint has no tokenizer.json", code="no_tokenizer")
    return tok


def tokenize(server: Any, req: TokenizeRequest) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` for ``req`` (vLLM's answer)."""
    from exl3tools.server import detok

    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", param="prompt")
    tok = _tokenizer(server)
    name = server.model_name
    if req.model is not None:
        server.check_model(req.model)
    if req.messages is not None:
        if req.add_special_tokens:
            raise bad_request("add_special_tokens applies to a prompt: a chat's special tokens are its "
                              "template's", param="add_special_tokens")
        # tool_choice "none": the tools are rendered, no call grammar is built (nothing is sampled)
        chat = chat_request({"model": name, "messages": req.messages, "tools": req.tools, "tool_choice": "none",
                             "chat_template_kwargs": req.chat_template_kwargs,
                             "add_generation_prompt": req.add_generation_prompt})
        ids = server.prepare_chat(chat, limits=False).prompts[0]     # as a chat completion renders it
    else:
        server.guard().check_prompts([req.prompt])
        ids = detok.encode_ids(tok, req.prompt, add_special_tokens=req.add_special_tokens is not False)
    return {"count": len(ids), "max_model_len": server.runner.max_context, "tokens": ids,
            "token_strs": [tok.id_to_token(i) for i in ids] if req.return_token_strs else None}


def detokenize(server: Any, req: DetokenizeRequest) -> dict[str, Any]:
    """``{"prompt"}``: ``req.tokens`` as text, special tokens kept (vLLM's answer)."""
    tok = _tokenizer(server)
    if req.model is not None:
        server.check_model(req.model)
    vocab = server.runner.vocab_size
    if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= vocab):
        raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
