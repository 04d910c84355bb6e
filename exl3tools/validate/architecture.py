"""E3xx: architecture completeness: every module config.json implies is stored, with its shape."""

from __future__ import annotations

from exl3tools.layout import expert_of
from exl3tools.validate.context import Context
from exl3tools.validate.findings import MAX_PER_CODE

FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def check_architecture(ctx: Context) -> None:
    if ctx.expected is None:
        return
    ck, add, T, sc = ctx.ckpt, ctx.sink.add, ctx.ckpt.tensors, ctx.scan
    cfg = ck.config
    if ctx.bad_files and ck.index is None:
        add("W305", None, None, "completeness not checked: a file without an index could not be read")
        return
    skipped = 0
    covered: set[str] = set()
    for e in ctx.expected:
        if e.kind == "linear":
            lin = sc.linears.get(e.name)
            if lin is not None:
                covered.update(f"{e.name}.{s}" for s in lin.suffixes)
                if e.bias and not lin.has_bias:
                    add("E307", ctx.file_of(f"{e.name}.trellis"), e.name, "no bias but config.json says attention_bias")
                continue
            w = T.get(f"{e.name}.weight")
            if w is not None and f"{e.name}.trellis" not in T:  # unquantized linear (bitrate 16)
                covered.update({f"{e.name}.weight", f"{e.name}.bias"})
                _check_dense(ctx, f"{e.name}.weight", (e.out_real, e.in_real))
                continue
            if ctx.unreadable(e.name):
                skipped += 1
                continue
            code = "E309" if e.mtp else "E303" if expert_of(e.name) is not None else "E301"
            what = "MTP layer linear" if e.mtp else "expert projection" if code == "E303" else "linear"
            add(code, ctx.guess_file(e.name), e.name,
                f"{what} missing ({e.in_real} -> {e.out_real}; no .trellis or .weight)")
        else:
            if e.name in T:
                covered.add(e.name)
                _check_dense(ctx, e.name, e.shape)
            elif (e.name == "model.embed_tokens.weight" and "model.embed_tokens.trellis" in T
                  and "model.embed_tokens.signs" in T):
                covered.update({"model.embed_tokens.trellis", "model.embed_tokens.signs"})
            elif ctx.unreadable(e.name):
                skipped += 1
            else:
                code = "E309" if e.mtp else "E302"
                add(code, ctx.guess_file(e.name), e.name,
                    f"{'MTP layer tensor' if e.mtp else 'tensor'} missing (expected {list(e.shape) or 'dense'})")
    if skipped:
        add("W305", None, None, f"{skipped} expected modules not checked: their files could not be read")
    unexpected = [n for n in T if n not in covered]
    for n in unexpected[:MAX_PER_CODE]:  # the rest are only counted (10^6 hostile names)
        add("W302", ctx.file_of(n), n, "unexpected tensor: no loader for this architecture reads it")
    ctx.sink.skip("W302", len(unexpected) - MAX_PER_CODE)

    nextn = cfg.get("num_nextn_predict_layers") or 0
    nextn = nextn if isinstance(nextn, int) else 0
    L = ctx.num_layers
    if L is None:
        return
    if nextn > 0 and not ctx.mtp_layers:
        add("W303", "config.json", None, f"num_nextn_predict_layers is {nextn} but no MTP layer "
            f"(model.layers.{L}.*) is stored: the quant dropped it, speculative decoding is unavailable")
    for li in ctx.mtp_layers:
        if li >= L + nextn:
            add("W304", ctx._layer_files().get(li), f"model.layers.{li}",
                f"layer {li} is beyond num_hidden_layers {L} + num_nextn_predict_layers {nextn}")


def _check_dense(ctx: Context, name: str, shape: tuple[int, ...]) -> None:
    i = ctx.ckpt.tensors[name].info
    f = ctx.file_of(name)
    if i.dtype not in FLOAT_DTYPES:
        ctx.sink.add("E305", f, name, f"dtype {i.dtype}, expected a float dtype (BF16/F16/F32)")
    if shape and i.shape != tuple(shape):
        ctx.sink.add("E304", f, name, f"shape {list(i.shape)}, expected {list(shape)}")
