"""A reasoning model's thinking apart from its answer (``serve --reasoning-parser``).

GLM-4.5 and later, DeepSeek-R1 and Qwen3 think between ``<think>`` and ``</think>`` before they
answer. With a parser on, chat answers carry the thinking in ``message.reasoning_content`` (the
field DeepSeek's API and vLLM use; streamed as ``delta.reasoning_content``) and the rest in
``content``, where tool calls are then read (server/tools.py). The thinking starts where the
answer opens ``<think>`` (leading whitespace aside), or at the answer's first token when the
rendered prompt already ends inside an open ``<think>`` (DeepSeek-R1's and GLM's templates can
write it); it ends at ``</think>`` (newlines after it are dropped), or with the answer when
``max_tokens`` cuts it. An answer that does not think is all content. Under a grammar
(response_format, a forced tool call) the model may think first where both tags are single tokens
(``think_gate``: the grammar holds what follows ``</think>``); else the grammar holds the whole
answer, which is then not split. Where the tokenizer makes
the tags special tokens, the server decodes these answers with them as text (detok.keeping).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exl3tools.server.detok import held_prefix

OPEN, CLOSE = "<think>", "</think>"
# vLLM's --reasoning-parser names for these tags, accepted as aliases of "think"
PARSERS = ("none", "think", "deepseek_r1", "qwen3", "glm45")


# reasoning_effort (OpenAI) as thinking on or off: the chat templates of these models switch it
# whole (GLM-4.5+ and Qwen3 read ``enable_thinking``, DeepSeek-V3.1 ``thinking``)
EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


def template_switch(on: bool | None) -> dict[str, bool]:
    """The chat-template variables that turn a model's thinking on or off ({}: the template's
    default); a template that reads neither ignores them."""
    return {} if on is None else {"enable_thinking": on, "thinking": on}


def opens_inside(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>``: the answer starts thinking."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def think_gate(tokenizer, opened: bool) -> tuple[int, int, bool] | None:
    """The gate a grammar waits behind (SamplingParams.think_gate): the <think> and </think>
    tokens and whether the prompt opened the thinking; None unless each tag is one token (a
    reasoning model's vocabulary has them as added tokens): the grammar then holds the whole answer."""
    ids = [tokenizer.encode(tag, add_special_tokens=False).ids for tag in (OPEN, CLOSE)]
    if any(len(i) != 1 for i in ids):
        return None
    return ids[0][0], ids[1][0], opened


@dataclass(slots=True)
class ThinkSplitter:
    """One request's answers split into (reasoning, content), streamed or whole; per choice a state:
    "start" (may open), "inside", "post" (just closed: newlines dropped) or "after"."""

    inside_at_start: bool = False
    _state: dict[int, str] = field(default_factory=dict)
    _held: dict[int, str] = field(default_factory=dict)
    _thought: set[int] = field(default_factory=set)     # choices that opened a thinking part

    def feed(self, index: int, text: str) -> tuple[str, str]:
        """(reasoning, content) of ``text`` that may go out now; a partial tag is held."""
        state = self._state.get(index, "inside" if self.inside_at_start else "start")
        buf, reasoning, content = self._held.pop(index, "") + text, "", ""
        if state == "inside" or self.inside_at_start:
            self._thought.add(index)
        while buf:
            if state == "start":
                s = buf.lstrip()
                if not s or OPEN.startswith(s):
                    self._held[index] = buf        # whitespace or a partial <think>: not decided yet
                    buf = ""
                elif s.startswith(OPEN):
                    state, buf = "inside", s[len(OPEN):]
                    self._thought.add(index)
                else:
                    state = "after"
            elif state == "inside":
                at = buf.find(CLOSE)
                if at >= 0:
                    reasoning += buf[:at]
                    state, buf = "post", buf[at + len(CLOSE):]
                else:
                    keep = held_prefix(buf, CLOSE)
                    reasoning += buf[:len(buf) - keep]
                    if keep:
                        self._held[index] = buf[len(buf) - keep:]
                    buf = ""
            elif state == "post":
                buf = buf.lstrip("\n")
                if buf:
                    state = "after"
            else:
                content, buf = content + buf, ""
        self._state[index] = state
        return reasoning, content

    def finish(self, index: int) -> tuple[str, str]:
        """What ``index`` still holds when its answer ends: an undecided start is content, a
        partial ``</think>`` inside the thinking is thinking."""
        held = self._held.pop(index, "")
        state = self._state.pop(index, "inside" if self.inside_at_start else "start")
        return (held, "") if state == "inside" else ("", held)

    def thought(self, index: int) -> bool:
        """Whether choice ``index`` had a thinking part (its message then carries reasoning_content)."""
        return index in self._thought

    def split(self, index: int, text: str) -> tuple[str | None, str]:
        """A whole answer's (reasoning or None when it did not think, content)."""
        r1, c1 = self.feed(index, text)
        r2, c2 = self.finish(index)
        return (r1 + r2 if self.thought(index) else None), c1 + c2
