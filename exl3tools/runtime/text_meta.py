"""What a checkpoint folder says about its text besides the weights: the tokenizer, the eos / bos
tokens and ids, the chat template and generation_config.json's sampling defaults, read once when a
Runner starts (``read_text_meta``). A side file that is missing or unreadable counts as absent;
tokenizer.json, when present, must load (a one-line error otherwise)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exl3tools.runtime.loader import load_tokenizer


@dataclass(frozen=True)
class TextMeta:
    tokenizer: Any                      # tokenizers.Tokenizer or None
    eos_token_ids: frozenset[int]       # config.json, generation_config.json and the eos token's id
    eos_token: str | None
    bos_token: str | None
    bos_token_id: int | None
    chat_template: str | None
    generation_defaults: dict[str, float | int]


def read_text_meta(d: Path) -> TextMeta:
    """The text metadata of checkpoint folder ``d`` (module doc)."""
    tokenizer = load_tokenizer(d / "tokenizer.json")
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
    if isinstance(eos_tok, str) and tokenizer is not None:
        tid = tokenizer.token_to_id(eos_tok)
        if tid is not None:
            eos.add(tid)
    special = _json(d / "special_tokens_map.json") or {}
    bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
    tmpl = chat_template(d, tcfg)
    return TextMeta(
        tokenizer=tokenizer, eos_token_ids=frozenset(eos),
        eos_token=_token_text(tokenizer, tcfg, special, "eos_token", cfg.get("eos_token_id", gen.get("eos_token_id"))),
        bos_token=_token_text(tokenizer, tcfg, special, "bos_token", bos),
        bos_token_id=bos if isinstance(bos, int) else None,
        chat_template=tmpl,
        generation_defaults=generation_defaults(gen))


def _token_text(tokenizer, tcfg: dict, special: dict, key: str, ids) -> str | None:
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
    if isinstance(tid, int) and not isinstance(tid, bool) and tokenizer is not None:
        return tokenizer.id_to_token(tid)
    return None


def chat_template(d: Path, tcfg: dict) -> str | None:
    """The checkpoint's chat template, in transformers' order (PR #33957): a standalone
    chat_template.jinja, then chat_template.json's "chat_template" (the processor format), then
    tokenizer_config.json's. A str, or the "default" (else first) of [{"name", "template"}]."""
    jinja = d / "chat_template.jinja"
    try:
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    for src in (_json(d / "chat_template.json") or {}, tcfg):
        tmpl = src.get("chat_template") if isinstance(src, dict) else None
        if isinstance(tmpl, list):
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if isinstance(tmpl, str):
            return tmpl
    return None


def generation_defaults(gen: dict) -> dict[str, float | int]:
    """generation_config.json's request defaults that are usable, as vLLM's ``--generation-config
    auto`` takes them: ``temperature`` (>= 0), ``top_p`` (0 < p <= 1), ``top_k`` (>= 0, 0 = off),
    ``repetition_penalty`` (> 0), ``min_p`` (0..1) and ``max_new_tokens`` (>= 1, as ``max_tokens``).
    ``do_sample`` is not consulted (as vLLM): a file that names a temperature means it."""
    out: dict[str, float | int] = {}

    def num(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")

    t, p, k = gen.get("temperature"), gen.get("top_p"), gen.get("top_k")
    rp, mp, mt = gen.get("repetition_penalty"), gen.get("min_p"), gen.get("max_new_tokens")
    if num(t) and t >= 0:
        out["temperature"] = float(t)
    if num(p) and 0 < p <= 1:
        out["top_p"] = float(p)
    if isinstance(k, int) and not isinstance(k, bool):
        out["top_k"] = max(0, k)
    if num(rp) and 0 < rp <= 10:     # the request field's own range (server/request_models.py)
        out["repetition_penalty"] = float(rp)
    if num(mp) and 0 <= mp <= 1:
        out["min_p"] = float(mp)
    if isinstance(mt, int) and not isinstance(mt, bool) and mt >= 1:
        out["max_tokens"] = mt
    return out


def _json(p: Path):
    try:
        return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None
    except (OSError, ValueError):
        return None
