"""CausalLM: embedding -> decoder layers -> final norm -> lm_head, over a packed batch.

Architecture files (``runtime/arch/<name>.py``) build one of these from config.json; the model
itself does not know which architecture it runs. ``forward`` takes a packed batch of new tokens
of several sequences (prefill and decode mixed) and returns logits for the rows asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exl3tools.runtime.cache import SeqCache
from exl3tools.runtime.layers import Batch, SeqSpan
from exl3tools.runtime.sampling import on_device
from exl3tools.runtime.tp import TPContext


@dataclass(slots=True)
class ModelInfo:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_context: int


class CausalLM:
    def __init__(self, *, info: ModelInfo, embed: torch.Tensor, layers: list, norm, head, tp: TPContext,
                 head_sharded: bool = False):
        self.info, self.embed, self.layers, self.norm, self.head, self.tp = info, embed, layers, norm, head, tp
        self.head_sharded = head_sharded   # lm_head column-cut by vocab: gather the logits
        self._head_widths: list[int] | None = None
        self.weight_reads = None           # roofline.DecodeReads, set by rank_model.build_local_model

    def new_cache(self) -> SeqCache:
        return SeqCache(len(self.layers))

    @torch.inference_mode()
    def forward(self, items: list[tuple[SeqCache, list[int]]], *, all_logits: bool = False,
                to_cpu: bool = True, states: bool = False, body=None):
        """Append each sequence's tokens to its cache (a SeqCache, or a kv_pool.PagedSeqView);
        logits (float32, on the CPU unless ``to_cpu`` is False) for the last new token of each
        sequence, shape (len(items), vocab), or for every new row when ``all_logits``. With
        ``states``: (logits, the final-normed hidden state of every new row on the model's device),
        what an MTP draft head reads (runtime/mtp.py). ``body(token ids, batch)``: every row's
        final-normed states in place of the layers' own glue (fused_step.FusedGqaStep.eager)."""
        spans, ids, pos = [], [], []
        row = 0
        for cache, tokens in items:
            p0 = cache.length
            spans.append(SeqSpan(cache, row, len(tokens), p0))
            ids.extend(tokens)
            pos.extend(range(p0, p0 + len(tokens)))
            row += len(tokens)
        dev = self.embed.device
        # positions, ids and the last rows' index in one copy through pinned memory (on_device): a
        # tensor built on CUDA from a list syncs the stream
        n = len(pos)
        flat = on_device(pos + ids + ([] if all_logits else [s.row + s.n - 1 for s in spans]), dev)
        batch, tokens = Batch(spans, flat[:n]), flat[n:2 * n]
        last = None if all_logits else flat[2 * n:]
        if body is not None:
            hn = body(tokens, batch)
        else:
            h = self.embed[tokens].float()
            for layer in self.layers:
                h = layer(h, batch)
            if not states and last is not None:       # the final norm of the rows asked for only
                h, last = h[last], None
            hn = self.norm(h)
        logits = self.logits(hn if last is None else hn[last])
        logits = logits.cpu() if to_cpu else logits
        return (logits, hn) if states else logits

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head of final-normed states: gathered across ranks when the head is cut by vocab,
        trimmed to the real vocab, float32 (on the model's device)."""
        logits = self.head(h)
        if self.head_sharded:
            logits = self.tp.all_gather_cat(logits, self.head_widths(logits.shape[-1]), dim=-1)
        return logits[:, :self.info.vocab_size].float()

    def head_widths(self, mine: int) -> list[int]:
        """Every rank's lm_head width (``mine``: this rank's), gathered on first use. Every rank
        calls it at the same point (``PagedState`` asks before any step is captured), so the
        forward's gather has no object collective: that one synced the host at every step and
        cannot be captured in a CUDA graph."""
        if self._head_widths is None:
            self._head_widths = self.tp.sizes(mine)
        return self._head_widths
