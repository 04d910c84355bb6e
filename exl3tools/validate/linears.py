"""E2xx: every EXL3 linear's parts, dtypes, ranks, dims, K, codebook markers and biases (exl3-format.md §3)."""

from __future__ import annotations

from collections import Counter, defaultdict

from exl3tools.exl3 import CODEBOOKS, WIDTH_TO_K
from exl3tools.layout import pad128
from exl3tools.validate.context import Context

EXL3_PARTS = ("suh", "svh", "su", "sv", "mcg", "mul1", "scale")


def check_linears(ctx: Context) -> None:
    ck, add, T = ctx.ckpt, ctx.sink.add, ctx.ckpt.tensors
    q = ck.quantization_config or {}
    cfg_cb = q.get("codebook") if q.get("codebook") in CODEBOOKS else None
    cb_mismatch: list[str] = []
    real_of, padded_of = ctx.real.get, ctx.padded.get
    for p, lin in ctx.scan.linears.items():
        ref = T[f"{p}.trellis"]
        tr = ref.info
        f = ref.file.name
        sufs = lin.suffixes  # exactly the EXL3 suffixes s with f"{p}.{s}" in T: no lookups for the absent ones
        broken = False
        if tr.dtype != "I16":
            add("E202", f, f"{p}.trellis", f"trellis dtype {tr.dtype}, must be I16")
            broken = True
        if lin.signs == "missing":
            have = [s for s in ("suh", "svh", "su", "sv") if s in lin.suffixes]
            need = [s for s in ("suh", "svh") if s not in lin.suffixes]
            add("E201", f, p, f"trellis without {' and '.join(need)}" + (f" (has {', '.join(have)})" if have else ""))
            broken = True
        elif lin.signs == "mixed":
            add("E219", f, p, f"mixes legacy su/sv with suh/svh ({', '.join(s for s in lin.suffixes if s[0] == 's')})")
            broken = True
        if lin.bits is None:
            add("E209", f, f"{p}.trellis", f"trellis last dim {lin.width} is not a legal K (16..128 step 16, 24, 40, 56)")
            broken = True
        elif lin.width in (24, 40, 56) and lin.codebook != "mul1":
            add("E210", f, f"{p}.trellis", f"half-integer K {lin.bits:g} requires the mul1 marker (codebook is {lin.codebook})")
            broken = True
        for s, dt, size in (("suh", "F16", lin.k), ("svh", "F16", lin.n), ("su", "I16", lin.k // 16), ("sv", "I16", lin.n // 16)):
            if s not in sufs:
                continue
            i = T[f"{p}.{s}"].info
            if i.dtype != dt or len(i.shape) != 1:
                add("E205", f, f"{p}.{s}", f"{s} is {i.dtype}{list(i.shape)}, must be {dt} rank 1")
                broken = True
            elif i.shape[0] != size:
                dim = "k" if s in ("suh", "su") else "n"
                add("E206", f, f"{p}.{s}", f"{s} length {i.shape[0]} but trellis {list(tr.shape)} gives {dim} -> {size}")
                broken = True
        if lin.k % 128 or lin.n % 128:
            add("E207", f, f"{p}.trellis", f"padded dims k={lin.k}, n={lin.n} are not multiples of 128")
            broken = True
        real = real_of(p)
        want = padded_of(p) or (real and (pad128(real[0]), pad128(real[1])))
        if want and (want[0] != lin.k or want[1] != lin.n):
            how = "this rank's slice is" if p in ctx.padded else f"config.json dims {real[0]} -> {real[1]} pad to"
            add("E208", f, f"{p}.trellis", f"trellis {list(tr.shape)} is k={lin.k}, n={lin.n}; "
                f"{how} k={want[0]}, n={want[1]}")
            broken = True
        for m in ("mcg", "mul1"):
            if m not in sufs:
                continue
            ref = T[f"{p}.{m}"]
            if ref.info.dtype != "I32" or ref.info.shape != ():
                add("E211", f, f"{p}.{m}", f"marker is {ref.info.dtype}{list(ref.info.shape)}, must be a 0-d I32")
                broken = True
        if lin.codebook == "both":
            add("E213", f, p, "has both mcg and mul1 markers")
            broken = True
        elif cfg_cb and lin.codebook != cfg_cb:
            cb_mismatch.append(p)
        b = T[f"{p}.bias"] if lin.has_bias else None
        if b is not None and (b.info.dtype != "F16" or b.info.shape != (lin.n,)):
            add("E217", f, f"{p}.bias", f"bias is {b.info.dtype}{list(b.info.shape)}, must be F16 [{lin.n}]")
        if "scale" in sufs:
            add("E218", f, f"{p}.scale", "legacy scale tensor present: exllamav3 1.6.5 ignores it, so the decode would be wrong")
        if broken:
            ctx.broken.add(p)

    if cb_mismatch:
        if len(cb_mismatch) == len(ctx.scan.linears) and len(cb_mismatch) > 1:
            got = Counter(ctx.scan.linears[p].codebook for p in cb_mismatch).most_common(1)[0][0]
            add("E214", "config.json", None, f"quantization_config.codebook is {cfg_cb!r} but every linear is {got}")
        else:
            for p in cb_mismatch:
                add("E214", ctx.file_of(f"{p}.trellis"), p,
                    f"codebook {ctx.scan.linears[p].codebook}, quantization_config.codebook is {cfg_cb}")

    # one codebook per layer; one K per (layer, projection) across experts
    by_layer: dict[int | None, list] = defaultdict(list)
    by_proj: dict[tuple[int | None, str], list] = defaultdict(list)
    for lin in ctx.scan.linears.values():
        if lin.codebook == "both":
            continue
        by_layer[lin.layer].append(lin)
        if lin.expert is not None:
            by_proj[(lin.layer, lin.prefix.rsplit(".", 1)[-1])].append(lin)
    for li, lins in by_layer.items():
        if li is None:
            continue
        counts = Counter(x.codebook for x in lins)
        if len(counts) > 1:
            major = counts.most_common(1)[0][0]
            summary = ", ".join(f"{c} x{n}" for c, n in counts.most_common())
            for x in lins:
                if x.codebook != major:
                    add("E215", ctx.file_of(f"{x.prefix}.trellis"), x.prefix,
                        f"layer {li} mixes codebooks ({summary}); this linear is {x.codebook}")
    for (li, proj), lins in by_proj.items():
        counts = Counter(x.width for x in lins)
        if len(counts) > 1:
            major = counts.most_common(1)[0][0]
            for x in lins:
                if x.width != major:
                    add("E216", ctx.file_of(f"{x.prefix}.trellis"), x.prefix,
                        f"K {WIDTH_TO_K.get(x.width, x.width / 16):g} but the other experts' {proj} in layer {li} "
                        f"have K {WIDTH_TO_K.get(major, major / 16):g}")

    # EXL3 parts with no (rank-3) trellis
    for n, (_dtype, shape) in ctx.scan.dense.items():
        prefix, _, suffix = n.rpartition(".")
        if suffix == "trellis":
            if not (len(shape) == 2 and f"{prefix}.signs" in T):
                add("E203", ctx.file_of(n), n, f"trellis shape {list(shape)} is not rank 3")
                if len(shape) != 2:
                    ctx.broken.add(prefix)
        elif suffix in EXL3_PARTS and prefix not in ctx.scan.linears and f"{prefix}.signs" not in T:
            if f"{prefix}.trellis" not in T:
                add("E204", ctx.file_of(n), n, f"{suffix} without {prefix}.trellis")
