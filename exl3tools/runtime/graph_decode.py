"""Batched greedy-style decode with a static KV cache and no host sync per step (CUDA graphs).

``GraphDecoder(model, batch, max_len)`` keeps, per layer, K and V as ``(batch, max_len, kv_heads,
head_dim)`` float32 buffers and the positions of the rows in a device tensor. ``prefill`` runs the
eager runtime (CausalLM.forward) once per call and copies each row's K/V into the static cache.
``step(tokens)`` decodes one token for every row at its own position: the new K/V are written
with ``index_copy_``, attention runs over the whole ``max_len`` with a length mask, MoE layers use
``MoE.forward_static``, positions are incremented on the device. With ``graphs=True`` (default on
CUDA) the first step is warmed up and captured in a ``torch.cuda.CUDAGraph``; later steps copy the
tokens into the static input and replay it.

Rows can also be driven one at a time (the Runner's continuous batching): ``prefill_row`` /
``extend_row`` fill one row's slots from an eager forward without touching the others,
``reset_row`` empties a row, and ``step(tokens, active)`` advances only the active rows; an
inactive row writes its K/V into a scratch slot past ``max_len`` and keeps its position, so its
cache is untouched and its logits are meaningless.

GQA architectures only (llama, qwen3_moe, glm4_moe); MLA/DSA layers raise
UnsupportedArchitectureError. TP=1 only (the runner's TP protocol does not drive this yet).
"""

from __future__ import annotations

import torch

from exl3tools.errors import UnsupportedArchitectureError, UsageError
from exl3tools.runtime.layers import Attention, DecoderLayer, GatedMLP, MoE
from exl3tools.runtime.model import CausalLM

WARMUP_STEPS = 2     # eager runs before capture: Triton compiles, lazy buffers, cuBLAS handles


KV_DTYPE = torch.float32


class GraphDecoder:
    @staticmethod
    def check(model: CausalLM) -> None:
        """Raise where the graph path cannot run ``model`` (non-GQA layers, TP > 1)."""
        for i, layer in enumerate(model.layers):
            if not (isinstance(layer, DecoderLayer) and type(layer.attn) is Attention
                    and isinstance(layer.mlp, (GatedMLP, MoE))):
                raise UnsupportedArchitectureError(
                    f"graph decode supports GQA models (llama, qwen3_moe, glm4_moe); "
                    f"{model.info.architecture} layer {i} has {type(layer.attn).__name__} attention")
        if model.tp.world > 1:
            raise UsageError("graph decode runs TP=1 models only")

    @staticmethod
    def cache_bytes(model: CausalLM, batch: int, max_len: int) -> int:
        """Bytes of the static KV cache the constructor allocates (K and V, max_len + 1 slots)."""
        item = torch.empty((), dtype=KV_DTYPE).element_size()
        return sum(2 * batch * (max_len + 1) * layer.attn.nkv * layer.attn.hd * item for layer in model.layers)

    def __init__(self, model: CausalLM, batch: int, max_len: int, graphs: bool | None = None):
        self.check(model)
        if batch < 1 or max_len < 2:
            raise UsageError(f"graph decode needs batch >= 1 and max_len >= 2 (got {batch}, {max_len})")
        self.model, self.batch, self.max_len = model, int(batch), int(max_len)
        self.device = model.embed.device
        self.graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise UsageError("CUDA graphs need the model on a CUDA device")
        with torch.inference_mode():
            # slot max_len is scratch: inactive rows write there; an active row never sees it
            self.kv = [(torch.zeros(self.batch, self.max_len + 1, a.nkv, a.hd, dtype=KV_DTYPE, device=self.device),
                        torch.zeros(self.batch, self.max_len + 1, a.nkv, a.hd, dtype=KV_DTYPE, device=self.device))
                       for a in (layer.attn for layer in model.layers)]
            self.pos = torch.zeros(self.batch, dtype=torch.int64, device=self.device)
            self.tokens = torch.zeros(self.batch, dtype=torch.int64, device=self.device)
            self.active = torch.ones(self.batch, dtype=torch.bool, device=self.device)
            self._rows = torch.arange(self.batch, device=self.device)
            self._slots = torch.arange(self.max_len + 1, device=self.device)
        self._host_len: list[int] | None = None    # host copy of the positions: bounds checks, no sync
        self._graph = None
        self._out = None

    # ------------------------------------------------------------------ public
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Run each row's prompt (eager) and fill the static cache; logits (batch, vocab) float32."""
        if len(prompts) != self.batch:
            raise UsageError(f"prefill needs {self.batch} prompts, got {len(prompts)}")
        if any(not p or len(p) >= self.max_len for p in prompts):
            raise UsageError(f"every prompt needs 1..{self.max_len - 1} tokens")
        for row in range(self.batch):
            self.reset_row(row)
        return self.extend_rows(list(enumerate(prompts)))

    def row_length(self, row: int) -> int:
        """Tokens in ``row``'s cache (host copy, no sync)."""
        return 0 if self._host_len is None else self._host_len[self._row(row)]

    @torch.inference_mode()
    def reset_row(self, row: int) -> None:
        """Empty ``row`` (its slots are rewritten before they are read again)."""
        row = self._row(row)
        if self._host_len is None:
            self._host_len = [0] * self.batch
        self._host_len[row] = 0
        self.pos[row] = 0

    def prefill_row(self, row: int, tokens: list[int]) -> torch.Tensor:
        """Replace ``row``'s cache with ``tokens`` (eager forward); logits (vocab,) float32 on device."""
        self.reset_row(row)
        return self.extend_rows([(row, tokens)])[0]

    def extend_row(self, row: int, tokens: list[int]) -> torch.Tensor:
        """Append ``tokens`` to ``row``'s cache (eager forward); logits (vocab,) float32 on device."""
        return self.extend_rows([(row, tokens)])[0]

    @torch.inference_mode()
    def extend_rows(self, items: list[tuple[int, list[int]]], *, all_logits: bool = False) -> torch.Tensor:
        """Append each row's tokens in one eager forward (the rows' past is read back from the
        static cache); logits for each row's last token (or every token with ``all_logits``)."""
        if self._host_len is None:
            self._host_len = [0] * self.batch
        rows = [self._row(r) for r, _ in items]
        if len(set(rows)) != len(rows):
            raise UsageError("a row appears twice in one extend_rows call")
        for r, (_, toks) in zip(rows, items, strict=True):
            if not toks or self._host_len[r] + len(toks) > self.max_len:
                raise UsageError(f"row {r}: {self._host_len[r]} cached + {len(toks)} new tokens must be "
                                 f"1..{self.max_len}")
        caches = []
        for r in rows:
            c, n = self.model.new_cache(), self._host_len[r]
            if n:
                for (k, v), layer in zip(self.kv, self.model.layers, strict=True):
                    c.extend(layer.attn.layer, {"k": k[r, :n], "v": v[r, :n]})
            caches.append(c)
        logits = self.model.forward([(c, [int(t) for t in toks]) for c, (_, toks) in zip(caches, items, strict=True)],
                                    all_logits=all_logits)
        for r, c, (_, toks) in zip(rows, caches, items, strict=True):
            n0, n1 = self._host_len[r], self._host_len[r] + len(toks)
            for (k, v), layer in zip(self.kv, self.model.layers, strict=True):
                k[r, n0:n1] = c.layers[layer.attn.layer]["k"][n0:n1]
                v[r, n0:n1] = c.layers[layer.attn.layer]["v"][n0:n1]
            self._host_len[r] = n1
            self.pos[r] = n1
        return logits.to(self.device)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, active: torch.Tensor | list[bool] | None = None) -> torch.Tensor:
        """Decode ``tokens`` (batch,) at each active row's position (``active``: (batch,) bools,
        default all); logits (batch, vocab) float32 on device, those of inactive rows meaningless."""
        if self._host_len is None:
            raise UsageError("call prefill before step")
        if tuple(tokens.shape) != (self.batch,):
            raise UsageError(f"step needs {self.batch} tokens, got shape {tuple(tokens.shape)}")
        on = [True] * self.batch if active is None else [bool(a) for a in active]
        if len(on) != self.batch:
            raise UsageError(f"step needs {self.batch} active flags, got {len(on)}")
        if any(a and n >= self.max_len for a, n in zip(on, self._host_len, strict=True)):
            raise UsageError(f"a row reached max_len {self.max_len}")
        self.tokens.copy_(tokens, non_blocking=True)
        self.active.copy_(torch.tensor(on, dtype=torch.bool), non_blocking=True)
        if not self.graphs:
            out = self._body()
        else:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            out = self._out
        self._host_len = [n + a for n, a in zip(self._host_len, on, strict=True)]
        return out.clone()

    def kv_bytes(self) -> int:
        """Bytes of the static KV cache (every step reads all of it)."""
        return sum(t.numel() * t.element_size() for kv in self.kv for t in kv)

    def _row(self, row: int) -> int:
        if not 0 <= int(row) < self.batch:
            raise UsageError(f"row {row} out of range 0..{self.batch - 1}")
        return int(row)

    # ------------------------------------------------------------------ the step
    def _capture(self) -> None:
        saved = self.pos.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):   # writes K/V at pos (rewritten identically by the replay)
                self._body()
                self.pos.copy_(saved)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):      # recorded, not run: pos is still the saved value
            self._out = self._body()
        self._graph = graph

    def _body(self) -> torch.Tensor:
        """One decode step from ``self.tokens`` and ``self.pos``; device ops only, fixed shapes."""
        m = self.model
        h = m.embed.index_select(0, self.tokens).float()
        for (k, v), layer in zip(self.kv, m.layers, strict=True):
            h = h + self._attention(layer.attn, layer.attn_norm(h), k, v)
            x = layer.mlp_norm(h)
            h = h + (layer.mlp.forward_static(x) if isinstance(layer.mlp, MoE) else layer.mlp(x))
        logits = m.logits(m.norm(h))
        self.pos.add_(self.active.to(torch.int64))
        return logits

    def _attention(self, a: Attention, x: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        q, k, v = a.qkv(x, self.pos)
        slot = torch.where(self.active, self.pos, self.max_len)      # inactive rows: the scratch slot
        flat = self._rows * (self.max_len + 1) + slot                  # row b writes slot pos[b]
        kc.view(-1, a.nkv, a.hd).index_copy_(0, flat, k.to(kc.dtype))
        vc.view(-1, a.nkv, a.hd).index_copy_(0, flat, v.to(vc.dtype))
        g = a.nq // a.nkv                                              # q head i reads kv head i // g
        qg = q.view(B, a.nkv, g, a.hd)
        scores = torch.einsum("bhgd,blhd->bhgl", qg, kc) * a.scale     # (B, nkv, g, max_len)
        past = self._slots[None, :] > self.pos[:, None]               # (B, L): not yet written
        scores = scores.masked_fill(past[:, None, None, :], float("-inf"))
        o = torch.einsum("bhgl,blhd->bhgd", torch.softmax(scores, dim=-1), vc)
        return a.reduce(a.o(o.reshape(B, a.nq * a.hd)))
