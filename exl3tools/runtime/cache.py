"""Per-sequence KV cache: per layer, named tensors stored token-first and grown by doubling.

Token-first storage (``(tokens, ...)``) lets any attention kind keep what it needs under its own
names: GQA keeps ``k``/``v`` ``(tokens, kv_heads, head_dim)``; an MLA layer can keep its latent
``ckv``/``kpe``. Freeing a sequence drops its tensors at once.
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64


class SeqCache:
    def __init__(self, n_layers: int):
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layers)]
        self.lengths = [0] * n_layers

    @property
    def length(self) -> int:
        """Tokens committed (the length of layer 0's cache)."""
        return self.lengths[0] if self.lengths else 0

    def extend(self, layer: int, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Append ``new`` (each ``(n, ...)``) to ``layer`` and return views of the whole cache."""
        store = self.layers[layer]
        n0 = self.lengths[layer]
        n = next(iter(new.values())).shape[0]
        for name, t in new.items():
            buf = store.get(name)
            if buf is None or buf.shape[0] < n0 + n:
                cap = max(MIN_CAPACITY, 2 * (n0 + n))
                grown = torch.empty((cap, *t.shape[1:]), dtype=t.dtype, device=t.device)
                if buf is not None:
                    grown[:n0] = buf[:n0]
                store[name] = buf = grown
            buf[n0:n0 + n] = t
        self.lengths[layer] = n0 + n
        return {name: buf[:n0 + n] for name, buf in store.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())
