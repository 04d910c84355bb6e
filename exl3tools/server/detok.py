"""Incremental detokenisation with stop strings, shared by streaming and non-streaming paths (and
``encode_ids``, the prompts' way in).

Streaming output equals non-streaming output because both are the concatenation of the same
deltas. Text that could still become a stop string (or an incomplete UTF-8 sequence) is held back
until it is safe to release.
"""

from __future__ import annotations

from tokenizers import Tokenizer


def held_prefix(text: str, tag: str) -> int:
    """Length of ``text``'s longest proper suffix that starts ``tag``: what to hold back until the
    next text says whether ``tag`` begins there (stop strings, tool-call markers, <think>)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class TextTracker:
    """Feeds token ids in, releases text deltas; finds stop strings across token boundaries."""

    __slots__ = ("_tok", "_ids", "_prefix", "_read", "_text", "_sent", "_stops", "matched")

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # decode window start (context for byte-level merges)
        self._read = 0  # ids before this are already in _text
        self._text = ""  # everything decoded so far
        self._sent = 0  # characters of _text already released
        self._stops = stops
        self.matched: str | None = None  # the stop string that ended the text (add's hit)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append one token; returns (released text, hit a stop string)."""
        self._ids.append(token_id)
        self._text += self._decode_new()
        if self._stops:
            hit = self._find_stop()
            if hit is not None:
                out = self._text[self._sent:hit]
                self._text = self._text[:hit]
                self._sent = hit
                return out, True
        end = len(self._text) - self._held_back()
        out = self._text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out, False

    def flush(self) -> str:
        """The rest of the text when generation ends without a stop string."""
        if self._read < len(self._ids):  # trailing incomplete UTF-8: emit what decode gives
            prefix_text = self._decode(self._prefix, self._read)
            self._text += self._decode(self._prefix, len(self._ids))[len(prefix_text):]
            self._read = len(self._ids)
        out = self._text[self._sent:]
        self._sent = len(self._text)
        return out

    @property
    def offset(self) -> int:
        """Characters decoded so far: where the next token's text starts."""
        return len(self._text)

    @property
    def text(self) -> str:
        return self._text[: self._sent]

    def _decode(self, a: int, b: int) -> str:
        return self._tok.decode(self._ids[a:b], skip_special_tokens=True) if b > a else ""

    def _decode_new(self) -> str:
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self._ids))
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def _find_stop(self) -> int | None:
        longest = max(len(s) for s in self._stops)
        start = max(0, self._sent - longest + 1)
        best = None
        for s in self._stops:
            i = self._text.find(s, start)
            if i >= 0 and (best is None or i < best):
                best, self.matched = i, s
        return best

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        tail = self._text[self._sent:]
        return max((held_prefix(tail, s) for s in self._stops), default=0)


def encode_ids(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    """``text``'s ids as ``tokenizer.encode`` gives them, through ``encode_batch``, which releases
    the GIL while Rust tokenizes (``encode`` holds it: a 3500-token prompt 2.3 ms, during which
    the engine thread cannot launch a step; a burst of 32 such chat requests held it ~75 ms)."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def keeping(tokenizer: Tokenizer, contents: frozenset[str]) -> Tokenizer:
    """``tokenizer``, or a copy in which the added tokens ``contents`` (markers a parser reads:
    tool calls, <think>) are ordinary ones, so detokenizing keeps them as text where it skips the
    special ones. Encoding is the same either way (added tokens match in the text whatever their
    flag)."""
    import json

    data = json.loads(tokenizer.to_str())
    hits = [t for t in data.get("added_tokens", []) if t.get("special") and t.get("content") in contents]
    if not hits:
        return tokenizer
    for t in hits:
        t["special"] = False
    return Tokenizer.from_str(json.dumps(data))


def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes, inverted (char -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """A token's exact bytes and its logprobs display string (OpenAI's ``bytes:\\xNN`` for bytes
    that are not valid UTF-8 on their own)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        import json

        self._tok = tokenizer
        decoder = (json.loads(tokenizer.to_str()).get("decoder") or {})
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._table = _byte_level_table() if self._byte_level else {}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tok.id_to_token(token_id) or ""
        if self._byte_level and piece and all(ch in self._table for ch in piece):
            raw = bytes(self._table[ch] for ch in piece)
        else:
            raw = self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
