"""The Context every check reads: the opened checkpoint, its scan, the expected modules (localized
to a rank's slices when the directory is one rank of a rank-slice set) and the findings sink."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from exl3tools.checkpoint.counts import config_problems
from exl3tools.checkpoint.reader import Checkpoint
from exl3tools.errors import UnsupportedArchitectureError
from exl3tools.layout import Expected, Scan, expected_modules, expert_of, layer_of, pad128, scan_refs
from exl3tools.validate.findings import Sink


@dataclass
class Context:
    ckpt: Checkpoint
    sink: Sink
    bad_files: set[str]
    scan: Scan
    num_layers: int | None
    expected: list[Expected] | None
    real: dict[str, tuple[int, int]]
    mtp_layers: list[int]
    rank: dict | None = None                        # a rank dir's config.json "exl3tools" block
    padded: dict[str, tuple[int, int]] = field(default_factory=dict)  # rank slices: expected (k, n)
    broken: set[str] = field(default_factory=set)   # linear prefixes not safe to decode
    layer_file: dict[int | None, str] = field(default_factory=dict)

    @classmethod
    def build(cls, ckpt: Checkpoint, sink: Sink, bad: set[str]) -> Context:
        cfg = ckpt.config
        problems = config_problems(cfg, max(len(ckpt.tensors), len(ckpt.index or ())))
        for p in problems:  # a count that is not plausible bounds no loop: completeness is not checked
            sink.add("E100", "config.json", None, p)
        L = cfg.get("num_hidden_layers") if not problems else None
        L = L if isinstance(L, int) and not isinstance(L, bool) and L >= 0 else None
        sc = scan_refs(ckpt.tensors, L)
        mtp = [li for li in sorted(sc.layers) if L is not None and li >= L]
        expected = None
        if ckpt.config and not problems:
            try:
                expected = expected_modules(cfg, mtp)
            except UnsupportedArchitectureError as exc:
                msg = str(exc)
                if "lacks" in msg:
                    sink.add("E100", "config.json", None, msg)
                else:
                    sink.add("W301", "config.json", None, msg)
            except (TypeError, ValueError, AttributeError) as exc:
                sink.add("E100", "config.json", None, f"config values unusable ({type(exc).__name__}: {exc})")
        block = cfg.get("exl3tools")
        rank = block if isinstance(block, dict) and block.get("format") == "exl3tools.rank-slice" else None
        padded: dict[str, tuple[int, int]] = {}
        if rank is not None and expected is not None:
            expected, padded = localize(expected, rank)
        real = {e.name: (e.in_real, e.out_real) for e in expected or () if e.kind == "linear"}
        return cls(ckpt, sink, bad, sc, L, expected, real, mtp, rank, padded)

    def _layer_files(self) -> dict[int | None, str]:
        if not self.layer_file:  # built on first use: only missing tensors need it
            for n, r in self.ckpt.tensors.items():
                self.layer_file.setdefault(layer_of(n), r.file.name)
        return self.layer_file

    def file_of(self, name: str) -> str | None:
        ref = self.ckpt.tensors.get(name)
        return ref.file.name if ref else None

    def unreadable(self, name: str) -> bool:
        """Is ``name`` (a tensor or a module prefix) possibly in a file whose header failed?"""
        if not self.bad_files:
            return False
        idx = self.ckpt.index
        if idx is None:
            return True
        for n in (name, f"{name}.trellis", f"{name}.suh", f"{name}.weight"):
            if idx.get(n) in self.bad_files:
                return True
        return False

    def guess_file(self, name: str) -> str | None:
        if self.ckpt.index and name in self.ckpt.index:
            return self.ckpt.index[name]
        lf = self._layer_files()
        return lf.get(layer_of(name)) or lf.get(None)




# ----------------------------------------------------------------------------- rank dirs
def _local(real: int, m: dict) -> int:
    return max(0, min(real - m["first"], m["last"] - m["first"]))


def _cut(m: Any) -> tuple[str, int, int] | None:
    if isinstance(m, dict) and m.get("cut") in ("column", "row", "tp", "experts"):
        f, la = m.get("first"), m.get("last")
        if isinstance(f, int) and isinstance(la, int):
            return m["cut"], f, la
    return None


def localize(expected: list[Expected], block: dict) -> tuple[list[Expected], dict[str, tuple[int, int]]]:
    """Expected modules of one rank: cut dims shrunk to the slice, experts of other ranks dropped.

    Returns (expected, padded) where padded[prefix] = the (k, n) this rank's trellis must have.
    """
    mods = block.get("modules") if isinstance(block.get("modules"), dict) else {}
    out: list[Expected] = []
    padded: dict[str, tuple[int, int]] = {}
    for e in expected:
        if e.kind == "linear":
            ex = expert_of(e.name)
            m = mods.get(e.name.split(".mlp.experts.")[0] + ".mlp.experts") if ex is not None else mods.get(e.name)
            c = _cut(m)
            if c is None:
                out.append(e)
                continue
            cut, first, last = c
            proj = e.name.rsplit(".", 1)[-1]
            if cut == "experts":
                if first <= ex < last:
                    out.append(e)
                continue
            if cut == "tp":
                cut = "column" if proj in ("gate_proj", "up_proj") else "row"
            if cut == "column":
                out.append(dataclasses.replace(e, out_real=_local(e.out_real, m)))
                padded[e.name] = (pad128(e.in_real), last - first)
            else:
                out.append(dataclasses.replace(e, in_real=_local(e.in_real, m)))
                padded[e.name] = (last - first, pad128(e.out_real))
        else:
            m = mods.get(e.name.rsplit(".", 1)[0])
            c = _cut(m)
            if c is None or not e.shape:
                out.append(e)
                continue
            cut, first, last = c
            shape = ((last - first, *e.shape[1:]) if cut == "column" else
                     (e.shape[0], last - first, *e.shape[2:]) if len(e.shape) > 1 else e.shape)
            out.append(dataclasses.replace(e, shape=shape))
    return out, padded
