"""Paged MLA decode attention (kernels/mla_attention.py): the Triton kernel and the torch reference
against a float64 oracle written from the contract (per row: the attended positions, their latent
and rope rows looked up through the block table).

Every case poisons ``out`` with NaN, shuffles the block ids, fills table entries past each row's
length with ids that must never be read (a NaN block, out-of-range and negative ids) and NaNs the
unused slots of each row's last block; DSA cases pass a selection list with skipped (-1) entries.
On CUDA real shapes run (H 64/128, C 512, rope 64, contexts up to 32k); on the Triton interpreter
(TRITON_INTERPRET=1) small ones, within seconds.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import cuda_available

FULL = cuda_available()

# (B, H, C, R, block_size, lengths kind, selection K or 0, num_splits, precision)
if FULL:
    CASES = [(B, H, 512, 64, bs, "ragged", k, None, prec)
             for B in (1, 5) for H in (64, 128) for bs in (16, 64) for k in (0, 256) for prec in ("ieee", "tf32x3")]
    CASES += [(5, 16, 512, 64, 16, "ragged", 0, 3, "ieee"), (5, 128, 512, 64, 64, "ragged", 256, 3, "tf32x3")]
    CASES += [(2, 64, 512, 64, 64, "long", k, None, prec) for k in (0, 2048) for prec in ("ieee", "tf32x3")]
else:
    CASES = [
        (1, 4, 32, 16, 4, "ragged", 0, None, "ieee"),
        (3, 4, 32, 16, 8, "ragged", 0, 1, "ieee"),
        (4, 2, 48, 16, 4, "ragged", 0, 3, "ieee"),      # C not a power of two, more splits than tiles
        (3, 20, 32, 16, 16, "ragged", 0, 2, "ieee"),    # two head chunks (16 + 4)
        (3, 4, 32, 16, 4, "ragged", 8, 2, "ieee"),      # DSA selection, K 8
        (4, 4, 32, 16, 8, "ragged", 24, None, "ieee"),
        (2, 2, 160, 16, 4, "ragged", 0, 3, "ieee"),     # the merge in latent slices (MERGE_SLICE channels each)
    ]


def _lens(B: int, bs: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind == "long":
        return [32768, 9000][:B]
    pool = [0, 2 * bs + 5, 1, bs, 3 * bs, 2 * bs - 1]
    out = [pool[i] for i in range(min(B, len(pool)))]
    out += [int(torch.randint(1, 5 * bs, (1,), generator=gen)) for _ in range(B - len(out))]
    return out if B > 1 else [int(torch.randint(2, 4 * bs, (1,), generator=gen))]


def _case(B, H, C, R, bs, kind, K, dev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = _lens(B, bs, kind, gen)
    W = max(1, max(-(-n // bs) for n in lens)) + 1
    nblocks = B * W + 2
    ckv = torch.randn(nblocks, bs, C, generator=gen)
    kpe = torch.randn(nblocks, bs, R, generator=gen)
    nan_block = nblocks - 1
    ckv[nan_block] = float("nan")
    kpe[nan_block] = float("nan")
    ids = torch.randperm(nblocks - 1, generator=gen)
    tables = torch.empty(B, W, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        k = -(-n // bs)
        tables[b, :k] = ids[used:used + k].to(torch.int32)
        used += k
        junk = [nan_block, nblocks + 7, -3, 10**6]
        for c in range(k, W):
            tables[b, c] = junk[c % len(junk)]
        if n % bs:
            ckv[tables[b, k - 1], n % bs:] = float("nan")
            kpe[tables[b, k - 1], n % bs:] = float("nan")
    sel = None
    if K:
        sel = torch.full((B, K), -1, dtype=torch.int32)
        for b, n in enumerate(lens):
            pick = torch.randperm(n, generator=gen)[:K] if n > K else torch.arange(n)
            slots = torch.randperm(K, generator=gen)[:len(pick)]
            sel[b, slots] = pick.to(torch.int32)
    q_lat = torch.randn(B, H, C, generator=gen) * 0.05
    q_pe = torch.randn(B, H, R, generator=gen) * 0.05
    t = dict(q_lat=q_lat, q_pe=q_pe, ckv=ckv, kpe=kpe, block_tables=tables,
             context_lens=torch.tensor(lens, dtype=torch.int32), sel=sel)
    return {k: (v.to(dev) if v is not None else None) for k, v in t.items()}, lens


def _oracle(t, lens, scale):
    q_lat, q_pe = t["q_lat"].double().cpu(), t["q_pe"].double().cpu()
    ckv, kpe = t["ckv"].double().cpu(), t["kpe"].double().cpu()
    tables, sel = t["block_tables"].cpu(), t["sel"]
    bs = ckv.shape[1]
    out = torch.zeros(q_lat.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        pos = list(range(n)) if sel is None else [p for p in sel[b].tolist() if p >= 0]
        if not pos:
            continue
        cc = torch.stack([ckv[tables[b, p // bs], p % bs] for p in pos])
        kp = torch.stack([kpe[tables[b, p // bs], p % bs] for p in pos])
        s = (q_lat[b] @ cc.T + q_pe[b] @ kp.T) * scale
        out[b] = torch.softmax(s, -1) @ cc
    return out


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_mla_decode_matches_oracle(dev, case):
    from exl3tools.kernels.mla_attention import mla_decode, mla_decode_reference

    B, H, C, R, bs, kind, K, ns, prec = case
    t, lens = _case(B, H, C, R, bs, kind, K, dev)
    scale = (C // 4 + R) ** -0.5
    want = _oracle(t, lens, scale)
    for fn in (mla_decode, mla_decode_reference):
        out = torch.full((B, H, C), float("nan"), device=dev)
        got = fn(**t, scale=scale, num_splits=ns, out=out, precision=prec)
        assert got is out
        err = (got.cpu().double() - want).abs().max().item()
        tol = 2e-5 if prec == "ieee" else 1e-4
        assert err < tol, (fn.__name__, case, err)


def test_mla_decode_rejects_bad_inputs(dev):
    from exl3tools.kernels.mla_attention import mla_decode

    t, _ = _case(2, 4, 32, 16, 4, "ragged", 0, dev)
    bad = dict(t, block_tables=t["block_tables"].to(torch.int64))
    with pytest.raises(ValueError, match="block_tables"):
        mla_decode(**bad, scale=1.0)
    with pytest.raises(ValueError, match="share one of"):
        mla_decode(**dict(t, ckv=t["ckv"].half()), scale=1.0)      # planes of two dtypes
    with pytest.raises(ValueError, match="q_lat must be float32"):
        mla_decode(**dict(t, q_lat=t["q_lat"].half()), scale=1.0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[-2]], ids=["dense", "dsa"])
def test_mla_decode_reads_16_bit_planes(dev, case, dtype):
    """--kv-cache-dtype fp16/bf16 planes (MLAttention.cache_spec follows the pool) against the
    float64 oracle of the rounded planes: the reference and the kernel on bf16 widen them as they
    load (fp32 accuracy); the kernel on fp16 runs fp16 tensor-core dots (query and probabilities
    rounded to fp16, fp32 accumulation: ~2e-4 here)."""
    from exl3tools.kernels.mla_attention import mla_decode, mla_decode_reference

    B, H, C, R, bs, kind, K, ns, prec = case
    t, lens = _case(B, H, C, R, bs, kind, K, dev)
    t = dict(t, ckv=t["ckv"].to(getattr(torch, dtype)), kpe=t["kpe"].to(getattr(torch, dtype)))
    scale = (C // 4 + R) ** -0.5
    want = _oracle(t, lens, scale)
    for fn in (mla_decode, mla_decode_reference):
        err = (fn(**t, scale=scale, num_splits=ns, precision=prec).cpu().double() - want).abs().max().item()
        tol = 1e-3 if fn is mla_decode and dtype == "float16" else 2e-5
        assert err < tol, (fn.__name__, case, dtype, err)


@pytest.mark.parametrize("dsa", [True, False], ids=["dsa", "dense"])
@pytest.mark.parametrize("config", [(32, 32, 8), (16, 16, 8), (32, 64, 8), (32, 32, 4), (64, 16, 8), (64, 32, 8),
                                    (64, 64, 8)])
def test_mla_decode_head_and_key_tiles_on_fp16_planes(dev, config, dsa):
    """Other (heads, keys, warps) per program than the default, as MLAttention.attend_selected runs
    DSA prompt rows (32 x 32 x 8 on fp16 planes) and EXL3TOOLS_MLA_TILE picks them, against the
    float64 oracle: a DSA case and a dense one (several splits) with two head chunks. 64-head
    blocks take the queries as fp16 (mla_attention.Q16_MIN_HB)."""
    from exl3tools.kernels.mla_attention import mla_decode

    B, H, C, R, bs, kind, K, _, _ = CASES[-2] if dsa else CASES[1]
    H = max(H, config[0] + 8)                      # two chunks of HB heads, the second partial
    t, lens = _case(B, H, C, R, bs, kind, K, dev)
    t = dict(t, ckv=t["ckv"].half(), kpe=t["kpe"].half())
    scale = (C // 4 + R) ** -0.5
    hb, tn, w = config
    err = (mla_decode(**t, scale=scale, num_splits=1 if dsa else 3, head_block=hb, tile_n=tn, num_warps=w).cpu().double()
           - _oracle(t, lens, scale)).abs().max().item()
    assert err < 1e-3, (config, err)


@pytest.mark.parametrize("H", [2, 64] if FULL else [2])
@pytest.mark.parametrize(("config", "split_dots"), [
    (c, s) for c in [(16, 16, 8), (16, 64, 8), (32, 64, 8), (32, 32, 4), (64, 32, 8)] for s in (False, True)] if FULL
    # the interpreter (~3 s a case): both dot orders on the two-key-tile config, the other tiles chained
    else [((16, 16, 8), False), ((16, 16, 8), True), ((16, 64, 8), False), ((64, 16, 8), False)])
def test_mla_decode_rows_of_one_sequence(dev, config, H, split_dots):
    """The rows of one sequence's prompt in a decode graph (row steps, prompt graphs): 20 rows
    sharing one block-table row of a 4096-token-wide table, row i seeing i + 1 keys, 4 padding rows
    (no keys), fp16 planes, 11 splits (what a 24-row bucket takes on the H200). The shape on which
    the DeepSeek-V3 fixture's prompt rows came out wrong on the H200 at 16 x 64 tiles (2 heads,
    2026-12-02) while the interpreter agreed with the oracle; with the rope dot chained through the
    latent dot's accumulator (the kernel's way) and in one of its own (``split_dots``)."""
    from exl3tools.kernels.mla_attention import mla_decode

    gen = torch.Generator().manual_seed(3)
    n, pad, bs, width = 20, 4, 16, 256
    C, R = (512, 64) if FULL else (64, 16)
    nblocks = 8
    ckv = torch.randn(nblocks, bs, C, generator=gen).half()
    kpe = torch.randn(nblocks, bs, R, generator=gen).half()
    row = torch.zeros(width, dtype=torch.int32)         # unused entries: block 0, real data never to be read
    row[:2] = torch.tensor([5, 2], dtype=torch.int32)
    tables = row.expand(n + pad, -1).clone()
    lens = list(range(1, n + 1)) + [0] * pad
    t = dict(q_lat=torch.randn(n + pad, H, C, generator=gen) * 0.05, q_pe=torch.randn(n + pad, H, R, generator=gen) * 0.05,
             ckv=ckv, kpe=kpe, block_tables=tables, context_lens=torch.tensor(lens, dtype=torch.int32), sel=None)
    t = {k: (v.to(dev) if v is not None else None) for k, v in t.items()}
    scale = (C // 4 + R) ** -0.5
    hb, tn, w = config
    want = _oracle(t, lens, scale)
    got = mla_decode(**t, scale=scale, num_splits=11, head_block=hb, tile_n=tn, num_warps=w,
                     split_dots=split_dots).cpu().double()
    err = (got - want).abs().max().item()
    assert err < 1e-3, (config, H, split_dots, err)


@pytest.mark.parametrize("min_tiles", [1, 2, 5])
@pytest.mark.parametrize("dsa", [False, True], ids=["dense", "dsa"])
def test_mla_decode_min_split_tiles(dev, min_tiles, dsa):
    """Splits of at least ``min_split_tiles`` tiles (short contexts fill fewer splits; the empty
    ones write no partial and the merge skips them) against the float64 oracle, ragged lengths
    with an empty row, more splits than any row needs."""
    from exl3tools.kernels.mla_attention import mla_decode

    B, H, C, R, bs, kind, K, _, _ = CASES[-2] if dsa else CASES[1]
    t, lens = _case(B, H, C, R, bs, kind, K, dev)
    t = dict(t, ckv=t["ckv"].half(), kpe=t["kpe"].half())
    scale = (C // 4 + R) ** -0.5
    out = torch.full(t["q_lat"].shape, float("nan"), device=dev)
    got = mla_decode(**t, scale=scale, num_splits=7, tile_n=16, min_split_tiles=min_tiles, out=out)
    err = (got.cpu().double() - _oracle(t, lens, scale)).abs().max().item()
    assert err < 1e-3, (min_tiles, dsa, err)


@pytest.mark.parametrize("config", [None, (16, 2), (32, 8)], ids=["default", "16x2", "32x8"])
def test_mla_merge_drops_what_empty_splits_left(dev, config):
    """The merge against torch on partials whose empty splits (lse -inf) left NaN in their o slots
    (they write none): those slots are dropped, not weighted by 0 (NaN x 0 is NaN); a row whose
    splits are all empty merges to zeros; slices of the latent and several steps (config)."""
    from exl3tools.kernels.mla_attention import merge, merge_config

    gen = torch.Generator().manual_seed(3)
    B, H, parts, C = 2, 3, 11, 48
    po = torch.randn(B, H, parts, C, generator=gen)
    plse = torch.randn(B, H, parts, generator=gen) * 4
    empty = torch.rand(B, H, parts, generator=gen) < 0.3
    empty[1, 2] = True
    plse[empty] = float("-inf")
    po[empty] = float("nan")
    w = torch.exp2(plse - plse.amax(-1, keepdim=True).nan_to_num(neginf=0.0))
    want = (w[..., None] * po.nan_to_num()).sum(2) / w.sum(-1, keepdim=True).clamp_min(1e-30)
    out = torch.full((B, H, C), float("nan"), device=dev)
    merge(po.to(dev), plse.to(dev), out, config or merge_config(B * H, parts, C, None))
    got = out.cpu()
    assert torch.equal(got[1, 2], torch.zeros(C))
    assert (got - want).abs().max().item() < 1e-5


def test_merge_config_takes_every_partial_in_one_step_where_rows_are_few():
    """Few rows (one DeepSeek-V3 row: 128 heads x 64 partials): latent slices loading every
    partial at once, within MERGE_ELEMS; many rows: whole rows, partials in steps."""
    from exl3tools.kernels.mla_attention import MERGE_ELEMS, merge_config

    assert merge_config(128, 64, 512, 132) == (32, 64)
    assert merge_config(128, 3, 160, None) == (32, 4)     # the interpreter: slices (CPU coverage)
    assert merge_config(1024, 8, 512, 132) == (512, 8)
    assert merge_config(1024, 16, 512, 132) == (512, 8)   # two steps
    for rows, parts in ((1, 64), (64, 33), (4096, 2), (300, 64)):
        cp, sc = merge_config(rows, parts, 512, 132)
        assert cp * sc <= MERGE_ELEMS and sc & (sc - 1) == 0 and cp & (cp - 1) == 0


def test_wide_head_blocks_where_programs_fill_the_gpu(monkeypatch):
    """64 heads a program (fp16 queries) where B x head blocks x splits reaches
    WIDE_HEAD_PROGRAMS x the SMs, else 32 (the H200 sweep's crossover); never without B."""
    from exl3tools.kernels.mla_attention import default_config

    monkeypatch.delenv("EXL3TOOLS_MLA_WIDE_TILES", raising=False)
    f16 = torch.float16
    assert default_config(128, "ieee", f16, B=1, entries=32768, sms=132) == (64, 64, 8)   # 2 x 64 programs
    assert default_config(64, "ieee", f16, B=1, entries=32768, sms=132) == (32, 64, 8)    # 64 programs
    assert default_config(64, "ieee", f16, B=2, entries=32768, sms=132) == (64, 64, 8)
    assert default_config(128, "ieee", f16, B=1, entries=2048, sms=132) == (32, 64, 8)    # a selection: 2 x 32
    assert default_config(64, "ieee", f16, B=32, entries=2048, sms=132) == (64, 64, 8)
    assert default_config(128, "ieee", torch.float32, B=32, entries=4096, sms=132) == (16, 16, 8)
    monkeypatch.setenv("EXL3TOOLS_MLA_WIDE_TILES", "0")
    assert default_config(128, "ieee", f16, B=32, entries=4096, sms=132) == (16, 16, 8)


def test_splits_fill_whole_waves_where_one_program_holds_an_sm(monkeypatch):
    """fp16 planes' wide tiles hold one program an SM: the splits minimise waves x (tiles a split +
    overhead), so batch 32 at 128 heads takes 2 splits (128 programs, one wave), not 5 (320
    programs, a third wave 42 % full); batch 1 still spreads a 32k context over 64 splits. Other
    tiles keep about two programs an SM."""
    from exl3tools.kernels import mla_attention as m

    monkeypatch.delenv("EXL3TOOLS_MLA_WAVE_SPLITS", raising=False)
    wave = {(1, 2, 32768): 64, (1, 2, 2048): 32, (32, 2, 4096): 2, (32, 2, 32768): 2, (8, 2, 4096): 8,
            (64, 2, 4096): 1, (32, 1, 2048): 4, (64, 1, 2048): 2}
    for (B, chunks, entries), want in wave.items():
        assert m.default_num_splits(B, chunks, entries, 64, 132, one_per_sm=True) == want, (B, chunks, entries)
    assert m.default_num_splits(32, 2, 4096, 64, 132) == 5
    assert m.default_num_splits(1, 2, 32768, 64, 132) == 64


def test_wide_tiles_on_fp16_planes_unless_opted_out(monkeypatch):
    """fp16 planes take 32 (or, below 32 heads, 16) heads x 64 keys x 8 warps unless
    EXL3TOOLS_MLA_WIDE_TILES=0; fp32 planes always, and the opt-out, the 16 x 16 x 8 tiles."""
    from exl3tools.kernels.mla_attention import default_config

    monkeypatch.delenv("EXL3TOOLS_MLA_WIDE_TILES", raising=False)
    assert default_config(128, "ieee", torch.float16) == (32, 64, 8)
    assert default_config(2, "ieee", torch.float16) == (16, 64, 8)
    assert default_config(128, "ieee", torch.float32) == (16, 16, 8)
    monkeypatch.setenv("EXL3TOOLS_MLA_WIDE_TILES", "0")
    assert default_config(128, "ieee", torch.float16) == default_config(128, "ieee") == (16, 16, 8)


@pytest.mark.parametrize("value,want", [(None, None), ("", None), ("32,32,8", (32, 32, 8)), ("16,64,4", (16, 64, 4)),
                                        ("32,32", "HB,TN,WARPS"), ("a,b,c", "HB,TN,WARPS"), ("8,32,8", "powers of two"),
                                        ("32,24,8", "powers of two"), ("32,32,0", "powers of two")])
def test_mla_tile_override_parses_or_refuses_in_one_line(value, want):
    """EXL3TOOLS_MLA_TILE (the serve benchmark's way to time a sweep's winner): HB,TN,WARPS, or a
    UsageError (one line, exit 2) naming the variable."""
    from exl3tools.kernels.mla_attention import tile_override

    from exl3tools.errors import UsageError

    if want is None or isinstance(want, tuple):
        assert tile_override(value) == want
        return
    with pytest.raises(UsageError, match=want) as e:
        tile_override(value)
    assert "EXL3TOOLS_MLA_TILE" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError, match="EXL3TOOLS_MLA_SELECT_TILE"):
        tile_override(value, "EXL3TOOLS_MLA_SELECT_TILE")


@pytest.mark.parametrize("B,NH,D,bs", [(3, 4, 32, 4), (2, 20, 48, 8)] + ([(4, 32, 128, 16), (2, 64, 128, 64)]
                                                                        if FULL else []))
def test_dsa_paged_scores_match_the_reference(dev, B, NH, D, bs):
    """kernels/dsa_indexer.paged_scores vs runtime.dsa.paged_scores_reference: -inf at the same
    places (past each row's length, the whole padded width), fp16 values equal to within one ulp;
    on an fp16 plane the FMA kernel gives the fp32 plane's scores exactly, and the tensor-core
    kernel (tensor_cores=True) the same within the same bounds."""
    from exl3tools.kernels.dsa_indexer import paged_scores

    from exl3tools.runtime.dsa import paged_scores_reference

    t, lens = _case(B, NH, D, 16, bs, "ragged", 0, dev, seed=1)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, NH, D, generator=gen).half().float().to(dev)
    w = torch.randn(B, NH, generator=gen).half().float().to(dev)
    kidx = torch.randn(t["ckv"].shape[0], bs, D, generator=gen).half().float().to(dev)
    scale = D ** -0.5 * NH ** -0.5
    got = paged_scores(q, w, kidx, t["block_tables"], t["context_lens"], scale).cpu()
    want = paged_scores_reference(q, w, kidx, t["block_tables"], t["context_lens"], scale).cpu()
    # an fp16 plane holding the same (fp16-exact) keys is widened on load: the same scores
    args = (q, w, kidx.half(), t["block_tables"], t["context_lens"], scale)
    assert torch.equal(paged_scores(*args).cpu(), got)
    assert torch.equal(paged_scores_reference(*args).cpu(), want)
    fin = torch.isfinite(want)
    for b, n in enumerate(lens):
        assert fin[b, :n].all() and not fin[b, n:].any()
    for s in (got, paged_scores(*args, tensor_cores=True).cpu()):
        assert s.shape == want.shape == (B, t["block_tables"].shape[1] * bs)
        assert torch.equal(torch.isinf(s), torch.isinf(want))
        assert ((s[fin] - want[fin]).abs() <= want[fin].abs() * 2**-10 + 1e-7).all()
        assert (s[fin] == want[fin]).float().mean() > 0.99


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("T,k", [(300, 16), (5000, 2048)] + ([(4352, 2048), (131072, 2048)] if FULL else []))
def test_dsa_topk_select_picks_topk_positions_set(dev, T, k, chunked):
    """kernels/dsa_indexer.topk_select (and topk_select_chunked) vs runtime.dsa.topk_positions on
    real widths: the same set of positions per row (ties among coarse fp16 scores, contexts below,
    at and past k, -inf beyond)."""
    from exl3tools.kernels import dsa_indexer

    topk_select = dsa_indexer.topk_select_chunked if chunked else dsa_indexer.topk_select

    from exl3tools.runtime.dsa import topk_positions

    gen = torch.Generator().manual_seed(3)
    s = (torch.randn(6, T, generator=gen) * 4).round().half().float()         # many exact ties
    ctx = torch.tensor([T, T - 1, k + 1, k, max(T // 3, 1), 5], dtype=torch.int32).clamp(max=T)
    for b, n in enumerate(ctx.tolist()):
        s[b, n:] = float("-inf")
    s, ctx = s.to(dev), ctx.to(dev)
    got, want = topk_select(s, ctx, k).cpu(), topk_positions(s, ctx, k).cpu()
    assert got.shape == want.shape
    for b in range(6):
        assert sorted(got[b][got[b] >= 0].tolist()) == sorted(want[b][want[b] >= 0].tolist()), b
        assert (got[b] < 0).sum() == (want[b] < 0).sum(), b


@pytest.mark.parametrize("tensor_cores", [True, False, "opt_out"])
def test_dsa_select_with_the_first_pass_in_the_scores(dev, tensor_cores, monkeypatch):
    """kernels/dsa_indexer.select, the decode step's selection: with the tensor-core scores and the
    chunked top-k the scores kernel makes the top-k's first pass (its key histogram); any score
    kernel can (``paged_scores(hist=)``). Both pick runtime.dsa's reference set from raw
    (unrounded, strided) head weights, as the decode step passes them, over several chunks a row
    with coarse keys (ties at the threshold), rows at, below and past topk and an empty one."""
    from exl3tools.kernels import dsa_indexer as di

    from exl3tools.runtime.dsa import paged_scores_reference, topk_positions

    B, NH, D, bs, W, topk = 5, 4, 32, 16, 320, 2048          # 5120 scores a row: 3 chunks of 2048
    gen = torch.Generator().manual_seed(7)
    q = (torch.randint(-2, 3, (B, NH, D), generator=gen).float() / 2).to(dev)
    proj = torch.randn(B, 3 + NH, generator=gen).to(dev)      # key columns, then the head weights
    w = proj[:, 3:]
    kidx = (torch.randint(-2, 3, (B * W + 1, bs, D), generator=gen).float() / 2).half().to(dev)
    tables = torch.stack([torch.randperm(B * W, generator=gen)[:W] for _ in range(B)]).to(torch.int32).to(dev)
    ctx = torch.tensor([W * bs, 4000, topk + 1, topk, 0], dtype=torch.int32).to(dev)
    scale = D ** -0.5 * NH ** -0.5
    want = topk_positions(paged_scores_reference(q, w, kidx, tables, ctx, scale), ctx, topk).cpu()
    if tensor_cores:     # "opt_out" (EXL3TOOLS_DSA_FUSED_SELECT=0): the scores, then the top-k's three passes
        monkeypatch.setenv("EXL3TOOLS_DSA_FUSED_SELECT", "0" if tensor_cores == "opt_out" else "1")
        got = di.select(q, w, kidx, tables, ctx, scale, topk, di.paged_scores_tc, di.topk_select_chunked).cpu()
    else:
        hist = torch.zeros(B, 256, dtype=torch.int32, device=dev)
        s = di.paged_scores(q, w, kidx, tables, ctx, scale, hist=hist)
        got = di.topk_select_chunked(s, ctx, topk, hist=hist).cpu()
    assert got.shape == want.shape
    for b in range(B):
        assert sorted(got[b][got[b] >= 0].tolist()) == sorted(want[b][want[b] >= 0].tolist()), b
        assert (got[b] < 0).sum() == (want[b] < 0).sum(), b


def _wgmma_kernel_here() -> bool:
    from exl3tools.kernels import cuda_build

    return FULL and torch.cuda.get_device_capability() == (9, 0) and cuda_build.can_build_mla()


# (B, H, block_size, lengths kind, num_splits): ragged lengths with an empty row, one split (the
# output written directly), more splits than tiles (empty splits), two head blocks, every block size
WGMMA_CASES = [(B, H, bs, "ragged", ns) for B in (1, 5) for H in (64, 128) for bs in (8, 16, 64) for ns in (None, 1)]
WGMMA_CASES += [(2, 128, 16, "long", None), (2, 64, 32, "long", None), (5, 64, 16, "ragged", 64),
                (3, 128, 64, "ragged", 7)]


def _through_the_wgmma_kernel(monkeypatch, pingpong: str = "0") -> list:
    """Switch the CUDA kernel on and its ping-pong variant as asked ("1": the plain order,
    EXL3TOOLS_MLA_SCALED_P=0; "ps": P_A stored scaled, the default), and count its launches
    (mla_decode must take it, not Triton)."""
    from exl3tools.kernels import mla_cuda

    calls, real = [], mla_cuda.split
    # each launch's (num_splits, pingpong, scaled_p)
    monkeypatch.setattr(mla_cuda, "split", lambda *a, **k: (
        calls.append((a[10], k.get("pingpong"), k.get("scaled_p"))), real(*a, **k))[1])
    monkeypatch.setenv("EXL3TOOLS_MLA_CUDA", "1")
    monkeypatch.setenv("EXL3TOOLS_MLA_PINGPONG", "0" if pingpong == "0" else "1")
    monkeypatch.setenv("EXL3TOOLS_MLA_SCALED_P", "1" if pingpong == "ps" else "0")
    return calls


def _fp16_case(B, H, bs, kind, dev):
    """A dense case on fp16 planes (serve's for MLA on CUDA): (tensors, scale, float64 oracle)."""
    t, lens = _case(B, H, 512, 64, bs, kind, 0, dev)
    t = dict(t, ckv=t["ckv"].half(), kpe=t["kpe"].half())
    scale = (512 // 4 + 64) ** -0.5
    return t, scale, _oracle(t, lens, scale)


# the kernel computing S on both warpgroups, the ping-pong one in its plain order and the one
# storing P_A scaled (EXL3TOOLS_MLA_SCALED_P, the default)
VARIANTS = ["0", "1", "ps"]
VARIANT_IDS = ["two_s", "pingpong", "scaled_p"]


@pytest.mark.skipif(not _wgmma_kernel_here(), reason="the CUDA MLA kernel needs an sm_90 GPU and nvcc (or its cubin)")
@pytest.mark.parametrize("pingpong", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("case", WGMMA_CASES, ids=[str(c) for c in WGMMA_CASES])
def test_mla_wgmma_kernel_matches_oracle_and_triton(dev, case, pingpong, monkeypatch):
    """kernels/csrc/mla_decode.cu (EXL3TOOLS_MLA_CUDA; EXL3TOOLS_MLA_PINGPONG: each tile's scores by
    one warpgroup) on fp16 planes against the float64 oracle of the rounded planes and against the Triton kernel:
    NaN in unused slots (copied with their block, then zeroed) and junk table entries past each row
    (never read), partial last tiles, odd and even tile counts a split (the ping-pong kernel's
    pairs)."""
    from exl3tools.kernels.mla_attention import mla_decode

    B, H, bs, kind, ns = case
    t, scale, want = _fp16_case(B, H, bs, kind, dev)
    calls = _through_the_wgmma_kernel(monkeypatch, pingpong)
    out = torch.full((B, H, 512), float("nan"), device=dev)
    got = mla_decode(**t, scale=scale, num_splits=ns, out=out)
    assert got is out and calls, "mla_decode did not take the CUDA kernel"
    assert calls[0][1:] == (pingpong != "0", pingpong == "ps"), calls
    err = (got.cpu().double() - want).abs().max().item()
    assert err < 1e-3, (case, err)
    monkeypatch.setenv("EXL3TOOLS_MLA_CUDA", "0")
    triton_out = mla_decode(**t, scale=scale, num_splits=ns)
    assert len(calls) == 1
    assert (got - triton_out).abs().max().item() < 1e-3


# (B, H, block_size, lengths kind, num_splits): a tensor-parallel rank's heads (16, 32), a tail block (96)
PAD_CASES = [(B, H, bs, "ragged", ns) for B in (1, 5) for H in (16, 32, 96) for bs in (16, 64) for ns in (None, 1)]
PAD_CASES += [(2, 32, 16, "long", None)]


@pytest.mark.skipif(not _wgmma_kernel_here(), reason="the CUDA MLA kernel needs an sm_90 GPU and nvcc (or its cubin)")
@pytest.mark.parametrize("pingpong", ["1", "ps"], ids=["pingpong", "scaled_p"])
@pytest.mark.parametrize("case", PAD_CASES, ids=[str(c) for c in PAD_CASES])
def test_mla_wgmma_kernel_pads_heads(dev, case, pingpong, monkeypatch):
    """EXL3TOOLS_MLA_PAD_HEADS (the default): head counts that are not a multiple of 64 (a tensor-parallel rank's)
    on the ping-pong kernel's padded variant, against the float64 oracle; the padding rows write
    nothing (rows past the output stay NaN); with it "0" they stay on Triton."""
    from exl3tools.kernels.mla_attention import mla_decode

    B, H, bs, kind, ns = case
    t, scale, want = _fp16_case(B, H, bs, kind, dev)
    calls = _through_the_wgmma_kernel(monkeypatch, pingpong)
    monkeypatch.setenv("EXL3TOOLS_MLA_PAD_HEADS", "0")
    mla_decode(**t, scale=scale, num_splits=ns)
    assert not calls, "heads not in 64s took the CUDA kernel without the switch"
    monkeypatch.setenv("EXL3TOOLS_MLA_PAD_HEADS", "1")
    canary = torch.full((B + 4, H, 512), float("nan"), device=dev)
    got = mla_decode(**t, scale=scale, num_splits=ns, out=canary[:B])
    assert calls and calls[0][1:] == (True, pingpong == "ps"), calls
    assert torch.isnan(canary[B:]).all(), "a padding row was stored"
    err = (got.cpu().double() - want).abs().max().item()
    assert err < 1e-3, (case, err)


@pytest.mark.skipif(not _wgmma_kernel_here(), reason="the CUDA MLA kernel needs an sm_90 GPU and nvcc (or its cubin)")
def test_a_dsa_selection_stays_on_triton(dev, monkeypatch):
    """Rows with a selection take the Triton kernel even with the CUDA one switched on (its gathered
    rows measured slower there), and stay right."""
    from exl3tools.kernels.mla_attention import mla_decode

    t, lens = _case(5, 64, 512, 64, 16, "ragged", 256, dev)
    t = dict(t, ckv=t["ckv"].half(), kpe=t["kpe"].half())
    scale = (512 // 4 + 64) ** -0.5
    calls = _through_the_wgmma_kernel(monkeypatch)
    err = (mla_decode(**t, scale=scale).cpu().double() - _oracle(t, lens, scale)).abs().max().item()
    assert not calls and err < 1e-3, (calls, err)


@pytest.mark.skipif(not _wgmma_kernel_here(), reason="the CUDA MLA kernel needs an sm_90 GPU and nvcc (or its cubin)")
@pytest.mark.parametrize("pingpong", VARIANTS, ids=VARIANT_IDS)
def test_mla_wgmma_kernel_replays_in_a_cuda_graph(dev, pingpong, monkeypatch):
    """Captured once (the planes' tensor maps as parameters), replayed with shorter lengths written
    in place (as the decode graphs are): the replay follows the new lengths (the oracle of them)."""
    from exl3tools.kernels.mla_attention import mla_decode

    t, lens = _case(5, 128, 512, 64, 16, "ragged", 0, dev, seed=5)
    t = dict(t, ckv=t["ckv"].half(), kpe=t["kpe"].half())
    scale = (512 // 4 + 64) ** -0.5
    calls = _through_the_wgmma_kernel(monkeypatch, pingpong)
    out = torch.empty(t["q_lat"].shape, device=dev)
    mla_decode(**t, scale=scale, out=out)                  # builds and loads the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(**t, scale=scale, out=out)
    shorter = [max(0, n - 5) for n in lens]
    t["context_lens"].copy_(torch.tensor(shorter, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert len(calls) == 2
    err = (out.cpu().double() - _oracle(t, shorter, scale)).abs().max().item()
    assert err < 1e-3, err


@pytest.mark.skipif(not _wgmma_kernel_here(), reason="the CUDA MLA kernel needs an sm_90 GPU and nvcc (or its cubin)")
@pytest.mark.parametrize("layout", ["padded_rows", "gapped_blocks"])
def test_mla_wgmma_kernel_on_strided_planes(dev, layout, monkeypatch):
    """Planes that are views: rows padded (576 halves apart: still one run of slots, so the tensor
    maps take it with a 1152-byte row stride) run the CUDA kernel; blocks with gaps between them (no
    tensor map spans them) go to Triton. Both against the oracle."""
    from exl3tools.kernels.mla_attention import mla_decode

    t, lens = _case(5, 128, 512, 64, 16, "ragged", 0, dev, seed=9)
    nb, bs = t["ckv"].shape[:2]
    if layout == "padded_rows":
        ckv = torch.full((nb, bs, 576), float("nan"), device=dev, dtype=torch.float16)[..., :512]
        kpe = torch.full((nb, bs, 72), float("nan"), device=dev, dtype=torch.float16)[..., :64]
    else:
        ckv = torch.full((nb, 2 * bs, 512), float("nan"), device=dev, dtype=torch.float16)[:, :bs]
        kpe = torch.full((nb, 2 * bs, 64), float("nan"), device=dev, dtype=torch.float16)[:, :bs]
    ckv.copy_(t["ckv"])
    kpe.copy_(t["kpe"])
    t = dict(t, ckv=ckv, kpe=kpe)
    scale = (512 // 4 + 64) ** -0.5
    calls = _through_the_wgmma_kernel(monkeypatch)
    got = mla_decode(**t, scale=scale)
    assert bool(calls) == (layout == "padded_rows")
    err = (got.cpu().double() - _oracle(t, lens, scale)).abs().max().item()
    assert err < 1e-3, (layout, err)
