"""Decode paths written for CUDA that have not yet run on a GPU: off on CUDA until a GPU run has
checked them (tests/gpu, bench/gpu_all.sh), unless their switch is "1". On the CPU (the static step,
the Triton interpreter) the tests run them as they are; `bench/gpu_all.sh` turns them all on for
tests/gpu and serves and times them beside the defaults, so one device call checks and times both.
A switch leaves this table once its path has passed on a GPU and become the default; its variable
then stays as an opt-out ("0"): OPT_OUTS.
"""

from __future__ import annotations

import os

SWITCHES = {    # name -> variable: off on CUDA unless "1"
    # MLA models' eager steps (a prompt chunk beside decoding sequences): the decode and verify
    # rows attend in one pass of the decode step's kernels (MLAttention.attend_rows) instead of
    # one history gather and four einsums per sequence and layer (~48 torch calls each: 32
    # decoding sequences on a 78-layer GLM-5 make ~120k calls a step). Served on the H200
    # (2026-12-02 evening, GLM-5 shape, prompt graphs off): 8 streams 962 -> 1213 tok/s, 8 short
    # prompts joining 8 streams stall them 82 ms instead of 173, but 32 streams 1947 -> 1756; its
    # GPU tests pass on the H200 (2026-12-02 14:02, tests/gpu with the other previews on)
    "mla_eager_rows": "EXL3TOOLS_MLA_EAGER_ROWS",
    # linears of more than 64 rows (prompts): the output Hadamard pass and svh folded into the
    # decoded weights (kernels/cuda_dense.decode_fold, W' = Ŵ·H_n ⊙ svh rounded to fp16 once) and
    # the bias into cuBLAS's GEMM, instead of decode + GEMM + had_out, whose cost grows with the
    # rows; where rows x n >= cuda_exl3.FOLD_MIN_OUT. H200, 2026-12-02 (bench/gpu_bench.py, K 3,
    # 2048 rows): 4096 -> 14336 468 -> 440 us, 2048 -> 6144 123 -> 103, 14336 -> 4096 452 -> 459
    # (hence the threshold); at 256 rows 2-10 us slower everywhere (decode_fold 71 us against
    # decode's 59); a whole 2048-token forward unchanged (air6 47.6 vs 48.0 ms): it stays a preview
    "dense_fold": "EXL3TOOLS_DENSE_FOLD",
    # the decode of Ŵ for linears of more than 64 rows (kernels/cuda_dense.decode_t) on
    # exl3_decode_t_coop where the n-tiles come in fours: a warp loads its quad of tiles once in
    # 16-byte pieces (the next quad's while it decodes this one) and hands each lane its words
    # through shared memory, where exl3_decode_t's per-lane 4-byte loads fetch each tile's sectors
    # from L2 about three times (ncu on the H200, 2026-12-03 18:05 session: L2 82 % busy, DRAM 44 %).
    # H200 2026-12-04: tests/gpu passed with it; the decode alone 0.4-2.9 µs faster at all five
    # bench shapes (59.2 -> 58.8 µs at 4096 -> 14336), but a 2048-token air6 forward 37.55 vs 37.37
    # ms in 7 interleaved rounds (0.995, inside the spread): no gain measured, so it stays a preview
    "decode_coop": "EXL3TOOLS_DECODE_COOP",
    # the fused decode step's MoE from PAIR_TILES_MIN_SLOTS pairs (fused_step.py): expert-sorted
    # tiles over the routed experts and the shared one together, their rows put back in pair
    # order and summed by residual_rmsnorm as one row per pair is (fused_step._pairs_by_tiles,
    # the batch-invariant mode's path), instead of one row per pair (every pair decoding its
    # expert's weights, the shared expert's once per token) below MOE_TILES_MIN_SLOTS pairs and
    # _tiles_sum (shared expert apart) above
    "pair_tiles": "EXL3TOOLS_PAIR_TILES",
    # the fused decode step's MoE down projection takes the gate+up output as it is and computes
    # silu(gate) * up in its own input pass (had_in's, or gemv_pro's: exl3_had_in_act_*,
    # exl3_gemv_pro_act_*) instead of a silu_mul launch before it: one launch fewer a MoE layer
    # (H200 2026-12-03, the engine's decode loop on air6: batch 1 738 vs 739 tok/s, batch 8 2527 vs
    # 2537: no gain measured, so it stays a preview; tests/gpu passes with it)
    "act_input": "EXL3TOOLS_ACT_INPUT",
    # the fused decode step's expert groups (kernels/expert_groups.py) up to WIDE_MAX_PAIRS (2048)
    # pairs instead of MAX_PAIRS (512): batch 57 and above (--max-num-seqs 64: 576 pairs at 9 a
    # token; decode rows with drafts: 64 sequences x 2 rows, 1152) keep one tile per expert instead
    # of falling back to _tiles_sum (~25 torch launches a MoE layer, the shared expert apart). The
    # grouping kernel then compares in 16-element column blocks with 16 warps. H200 2026-12-03
    # 11:12: tests/gpu passes with it; the decode loop at batch 56 / 64 6584 / 7541 vs 6707 / 7740
    # tok/s without it, 64 served streams 6707 vs 6740: no gain measured, so it stays a preview
    "wide_groups": "EXL3TOOLS_WIDE_GROUPS",
    # dense linears of 65-128 rows with k >= 4096 (prompt-graph buckets of 96 and 128 rows, MTP
    # verify steps) on one slot of the 128-row shared-memory tile kernel, the weight decoded once
    # into the MMAs, instead of decode to fp16 + cuBLAS (cuda_exl3.DENSE_TILE_KERNEL; H200
    # 2026-12-03, 128 rows: 69-79 µs vs 105-115 at k >= 4096). tests/gpu passed with it (847); the
    # GLM-5 shape with --speculative-tokens 3 at 32 streams (128-row steps) served 851 tok/s either
    # way (steps 34.5 vs 35.5 ms): no served gain measured, so it stays a preview
    "dense_tiles": "EXL3TOOLS_DENSE_TILES",
    # dense linears of 65-1024 rows on Hopper's warpgroup MMA (kernels/csrc/exl3_wgmma.cuh,
    # cuda_exl3.WG_KERNELS): slots of 128 / 256 rows, the weight decoded once a slot into wgmma's
    # register operand while the activations stream through shared memory, instead of decode +
    # cuBLAS. Right on the H200 (2026-12-03) and slower than the default: at 4096 -> 14336, 128 /
    # 256 / 1024 rows 82.8 / 162.9 / 669.8 µs against 105.2 / 119.6 / 268.6 (and the 128-row tile
    # kernel's 78.5); it stays a preview, the tested base of the next design (docs/gpu.md)
    "wgmma": "EXL3TOOLS_WGMMA",
    # dense linears of 65-256 rows (prompt chunks, prompt-graph buckets, MTP verify steps, decode
    # batches past 64) on one 256-row slot of exl3_wga_m256_t2 (kernels/csrc/exl3_wgmma.cuh: every
    # warp decodes the next 64 k of 128 columns into shared memory while four warpgroups' wgmma
    # multiply this one; the trellis words and the activations come by TMA) instead of decode to
    # fp16 + cuBLAS (cuda_exl3.WGA_MAX_ROWS). H100, 2026-12-06 (bench/gpu_gemm_ab.py, graph replays,
    # K 3, against the fp16 cuBLAS GEMM of the same shape): 256 rows 4096 -> 14336 108 vs 133 µs
    # (1.87x cuBLAS, from 2.29x), 14336 -> 4096 88 vs 142 (1.28x, from 2.08x), 8192 -> 8192 101 vs
    # 149 (1.60x, from 2.36x); its GPU tests pass on every K and codebook. But a 256-token air6
    # forward is no faster (13.04 vs 12.95 ms, 7 interleaved rounds: its dense linears are small
    # beside the MoE), and as the default it moved tests/gpu's seeded serve test (its crowd's prompt
    # step of 65-256 rows; the draw 25 characters alike of 52, the bar 26; 1107 passed without it):
    # it stays a preview
    "dense_wga": "EXL3TOOLS_DENSE_WGA",
    # the eager forward's steps (those no fixed-shape or long step takes: every row's logits, MLA
    # models' prompt chunks) with the fused decode step's glue around each layer's own attention
    # (FusedGqaStep.eager: the embedding and first norm in one kernel, each residual add + RMSNorm
    # in one, the MoE through the routing kernel), where CausalLM.forward runs RMSNorm, the
    # residual adds and the router as torch ops; GQA and MLA models with a fused step. H100
    # 2026-12-07 (bench/gpu_prefill_series.py, the GLM-5 shape, 2048 tokens): right (its GPU test),
    # kernels 50.5 against 52.7 ms, wall time not told apart under the power cap; not yet served
    "fused_eager": "EXL3TOOLS_FUSED_EAGER",
}

# Former previews, on by default since an H200 run passed tests/gpu with them and timed `serve`
# faster (docs/gpu.md, docs/serve.md): off only when "0"
OPT_OUTS = {
    # steps past the prompt graphs (a long prompt chunk, alone or beside decoding rows) through the
    # fused decode step's glue run once eagerly (PagedDecoder.long_step: fused norms, RoPE + K/V
    # write, grouped q/k/v, the routing kernel), each sequence's rows attending in one pass of the
    # paged prefill kernel, instead of the eager forward's torch glue; GQA models (the fused
    # step's), steps without every row's logits. H100 2026-12-07 (bench/gpu_prefill_series.py,
    # air6, a 2048-token forward, 6 interleaved rounds): 33.4 ms against 35.9 (1106 kernels against
    # 1346, no host sync in either), activation peak 498 MB against 432; served (four servers
    # alternating, 8 cold 4096-token prompts each) TTFT 108 / 108 ms against 114 / 114, the
    # server's own 62.7 / 62.6 against 64.6 / 64.0; decode unchanged. tests/gpu passed with it (1200)
    "long_steps": "EXL3TOOLS_LONG_STEPS",
    # long steps of up to a long_steps.LONG_GRAPH_ROWS bucket (every 128 rows from 640 to 2048 past
    # the prompt buckets, and one that fits the largest planned step: --max-prefill-tokens beside
    # every decoding row, up to 4352) and LONG_GRAPH_SEQS (64) sequences padded to the bucket and
    # replayed as a CUDA graph captured with the prompt buckets (the prefill kernel on a fixed grid
    # of row tiles, paged_attention.prefill_tiles; one set of outputs for every bucket), so a long
    # prompt's chunk costs the GPU's time and not the host's ~1100 launches (a slow H100 host took
    # 55-100 ms for a 2048-token air6 step that another did in 33). H100 2026-12-07 10:08 (a fast
    # host, buckets 1024 / 2048 then; bench/gpu_prefill_series.py, air6, 2048 tokens, 6
    # interleaved rounds): 31.6 ms against the eager long step's 33.6, activation peak 33 MB
    # against 498; served (four servers alternating, 6 cold 2048-token prompts each) the server's
    # own TTFT 33.7 / 34.9 ms against 37.8 / 43.0 and its prefill steps 32.1 / 33.1 against 36.1 /
    # 41.6 ms a prompt, decode unchanged, KV 66.47 against 66.83 GB. H100 10:46 (a slow host, the
    # ladder): a 1100-token forward 22.5 ms (bucket 1152) against 53.8 (median of 4); served against
    # EXL3TOOLS_LONG_GRAPHS=0: 8 streams of 1500-token prompts 1188 against 835 tok/s (TTFT median
    # 146 against 286 ms), 2 such prompts joining 16 decoding streams stall them 36 ms against 56,
    # a cold 2048-token prompt 35.9 ms (the server's own) against 55.4, KV the same 66.47 GB,
    # ready after 21.7 s against 14.6 (13 captures); tests/gpu 1211 passed with it (0 failed)
    "long_graphs": "EXL3TOOLS_LONG_GRAPHS",
    # linears of more than cuda_exl3.WGR_MAX_ROWS rows (and those under WGR_MIN_WEIGHTS from
    # cuda_exl3.FOLD2_MIN_ROWS rows) with fp16 activations: both passes folded
    # (kernels/cuda_dense.decode_fold2: W = diag(suh) · H_k · Ŵ · H_n · diag(svh) / 128, the whole
    # weight, rounded to fp16 once), so that x itself goes into cuBLAS, no had_in and no had_out,
    # instead of had_in + decode + GEMM + had_out. H100 2026-12-06 (bench/gpu_bench.py, K 3, 2048
    # rows, µs): 14336 -> 4096 432.9 vs 464.9, 6144 -> 2048 94.5 vs 119.2, 2048 -> 6144 99.5 vs
    # 126.0, 4096 -> 14336 443.5 vs 470.3, 8192 -> 8192 506.3 vs 515.6; at 256 rows 0-12 % slower
    # (its decode 98 µs against 71 at 4096 x 14336: hence the rows). H100, 2026-12-06 19:15
    # (bench/gpu_gemm_ab.py, interleaved, x fp16 cuBLAS, 2048 rows): 1.21-1.26x against decode +
    # GEMM + had_out's 1.26-1.30x at five shapes of 50-117 M weights, 1.31-1.36x against 1.73-1.86x
    # at air6's small ones (4096 -> 1024 38.0 vs 54.3 µs); at 1024 rows under WGR_MIN_WEIGHTS
    # 1.46-1.57x against 1.75-1.92x. tests/gpu passed with it the default (1200); served (air6, the
    # openai client, four servers alternating) a 2048-token prompt's prefill step 37.8 / 36.9 ms
    # (the median of 5) against 52.6 / 44.9, decode unchanged
    "dense_fold_in": "EXL3TOOLS_DENSE_FOLD_IN",
    # the Hadamard passes (cuda_gemv.had_in / had_out: every linear's input and output rotation,
    # the experts' too) on the _grid kernels: block (row, j) of a 2-D grid takes the row's 128-column
    # blocks 8 j .. 8 j + 7, a warp each, so an item needs no 64-bit division of a flat index (nor a
    # row division without source or expert indices), and the butterflies are fma(v, ±1, o) (the
    # same bits). ncu had found the 1-D had_out at 2048 x 14336 issue-bound (~193 instructions an
    # item, issue slots 85 % busy, DRAM 47 %; the _grid path ~140). H100, 2026-12-06 (bench/gpu_bench.py
    # --ks 3 --rows 256,2048): at 2048 rows had_out 55.3 -> 51.6 µs (4096 -> 14336), had_in 60.9 ->
    # 51.3 (14336 -> 4096), 38.0 -> 32.6 (8192), never slower beyond 0.2 µs; a 2048-token air6
    # forward 39.42 -> 38.89 ms (7 interleaved rounds); tests/gpu 1080 passed with it on and as the
    # default; served, an 8192-token prompt's server-side TTFT 194.8 -> 193.6 ms. H100 only: not
    # yet on an H200 ("0": the flat 1-D grid)
    "had_grid": "EXL3TOOLS_HAD_GRID",
    # MLA prompts through decompressed K/V (MLAttention._sdpa_decompressed): each head group's K
    # (nope and rope parts) from one GEMM of [latent | rope key] with W_UK and an identity block,
    # instead of the nope GEMM and a torch.cat with the broadcast rope key, which copies every K
    # (~121 MB a head group at a 28k history). The GEMM grows by (C + rope)(nope + rope) / (C nope)
    # (1.69x at DeepSeek-V3's K part); the extended weight replaces W_UK (its view), +11.5 MB a
    # layer at 128 heads. H100, 2026-12-06 (bench/gpu_prefill.py --long 30000 --long-variants,
    # synthetic DeepSeek-V3, one process): a 30000-token prompt 2276 -> 2173 ms warm, its last chunk
    # 167.3 -> 152.8 ms (the cat's 19.6 ms gone, the K GEMMs +2.7); tests/gpu passed with it on
    # (1080); served (H100, one 30000-token prompt a server) its TTFT 2486 -> 2362 ms, decode the
    # same. Not yet on an H200 (docs/gpu-sessions.md, "Earlier plans for the next GPU session").
    # CUDA only (preview.on_cuda): the CPU reference keeps the cat unless asked ("1")
    "mla_k_gemm": "EXL3TOOLS_MLA_K_GEMM",
    # MUL1 linears of up to 4 real rows a slot (so also expert_groups' 8-row tiles holding 1-4) on
    # the halves layout (kernels/csrc/exl3_gemv.cu AFF; a build define, as gemv_halves): each
    # state's A entries are (1024 + byte sum, 1.0) straight from the dp4a, each activation row
    # feeds two B columns, (x, 0) and (0, x), so the MMA leaves x · h beside sum x and the split's
    # epilogue applies kappa and beta once, instead of a PRMT and an HFMA2 a pair of weights
    # (pair). The weights are then exact in fp32, not rounded to fp16. sm_90a SASS (K 3): the
    # 1-row gemv_pro loop 429 -> 376 instructions. At 6 blocks an SM it bought 0-5 % (H100
    # 2026-12-05 08:18; ncu: the 1-row kernel is latency-bound, issue slots 52 % busy against the
    # pair's 60 % at 7); at 7 blocks (72 registers at K 1-4) one row is 3-8 % faster (H100
    # 2026-12-05 10:55, bench/gpu_bench.py --graph off / on / on / off: 4096 -> 14336 K 2 28.5 ->
    # 26.1 µs, K 3 30.4 -> 29.5, K 4 30.9 -> 29.5; 8192 -> 8192 K 3 33.9 -> 32.6), four rows -3..+3 %.
    # tests/gpu passed with it the default (H100 2026-12-05 11:55: 1067 passed); not yet served A/B
    "gemv_affine": "EXL3TOOLS_GEMV_AFFINE",
    # linears and expert slots of one row: the gemv kernel rotates its own split of the activations
    # (had_in's arithmetic, into shared memory) instead of a had_in launch before it (kernels/csrc
    # gemv_body PRO, cuda_gemv.gemv_pro, GEMV_PRO_MAX_ROWS); and the fused decode step's q, k and v
    # (a dense MLP's gate and up) as one grouped call each (runtime.layers.LinearGroup ->
    # cuda_group.CudaGroup: column chunks of one width as the slots of one gemv launch, each with its
    # own trellis width, exl3_gemv_ld_*, and one output pass; 9 launches -> 2 at one row). H200
    # 2026-12-03 (docs/gpu.md): tests/gpu 803 passed with both on; the engine's decode loop on air6
    # 739 -> 786 tok/s at batch 1, 2537 -> 2544 at 8; served one stream 831 -> 892 and 836 -> 893
    # tok/s in two runs, 8 streams within the spread
    "gemv_prologue": "EXL3TOOLS_GEMV_PROLOGUE",
    "grouped_proj": "EXL3TOOLS_GROUPED_PROJ",
    # the fused decode step's MoE at 2 or more tokens (up to expert_groups.MAX_PAIRS pairs): the
    # pairs grouped into one 8-row tile per expert by one kernel (kernels/expert_groups.py), so each
    # expert's weights are decoded once, not once per pair (batch 8 on GLM-4.5-Air: 72 pairs, ~52
    # experts; the shared expert once instead of 8 times), in short units (cuda_gemv.TILE_UNIT_KTILES),
    # and residual_rmsnorm reads each pair's row from the tiles (y_rows); instead of one row per pair
    # below MOE_TILES_MIN_SLOTS pairs and _tiles_sum (expert_tiles' ~25 torch launches, the shared
    # expert apart) above. H200 2026-12-03 06:26 (docs/gpu.md): tests/gpu 819 passed with it on and
    # as the default; the engine's decode loop on air6 at batch 8 / 16 / 32 2669-2878 / 3862-4100 /
    # 5769-5975 tok/s vs 2489 / 3510 / 5293 without; served 8 / 32 streams 2651 / 2733 vs 2293 / 2081
    "expert_groups": "EXL3TOOLS_EXPERT_GROUPS",
    # MLA models' (DeepSeek-V3, GLM-5) fixed-shape decode step with the fused glue of the GQA step
    # (runtime/fused_step.py FusedMlaStep): one kernel per residual add + RMSNorm, the routing
    # kernel (with Fp16ChoiceMoE's fp16 pick), the grouped experts with the shared one inside, q_a
    # and kv_a as one grouped call, and inside the attention kernels/fused_mla.py's kernels (norms,
    # RoPEs, latent writes, the DSA indexer's keys and queries) with one RoPE table a step: 252 -> 84
    # kernels a step on the GLM-5 fixture (bench/count_decode_kernels.py --grouped). H200 2026-12-03
    # 13:24 (docs/gpu.md): tests/gpu passed its graph test; GLM-5 shape, the engine's decode loop
    # 294 -> 419 tok/s at batch 1, 1294 -> 1695 at 8, 2769 -> 3224 at 32; served 1 / 8 / 32 / 64
    # streams 361 / 1302 / 2499 / 3486 -> 515 / 1657 / 2889 / 3616 tok/s. Default on CUDA only
    # (preview.on_cuda): the CPU keeps the torch loop unless asked ("1")
    "fused_mla": "EXL3TOOLS_FUSED_MLA",
    "fused": "EXL3TOOLS_FUSED",            # Triton glue kernels in the GQA decode step (issue 15)
    "row_steps": "EXL3TOOLS_ROW_STEPS",    # several new tokens of one sequence as rows of the decode step
    # DSA's sparse decode graphs per block-table width (paged_decode.widths), not only the full one
    # (2026-12-02, GLM-5 shape at --max-model-len 131072: 8 streams 1111 -> 1237 tok/s)
    "dsa_widths": "EXL3TOOLS_DSA_WIDTHS",
    # the MTP head's cache in the block pool and its drafts as a fixed-shape step (PagedDecoder.draft)
    # (same run, --speculative-tokens 1: one stream 110 -> 187 tok/s, 8 streams 426 -> 568)
    "mtp_paged": "EXL3TOOLS_MTP_PAGED",
    # DSA top-k over chunks of the scores in parallel (kernels/dsa_indexer.topk_select_chunked) at
    # tables from CHUNKED_MIN_WIDTH (8192) wide; "1": at every width (2026-12-02 H200, with the
    # scores: 101 vs 189 us at a 32k table, 35 vs 32 at 4k)
    "dsa_topk_chunks": "EXL3TOOLS_DSA_TOPK_CHUNKS",
    # DSA indexer scores with fp16 tensor-core dots, 256 keys a program and the queries loaded once
    # (kernels/dsa_indexer._scores_tc_kernel); 2026-12-02 H200: 82 -> 12 us at batch 1 and a 32k
    # table, 2361 -> 82 us at batch 32; GLM-5 shape, one stream at a 30000-token context 270 -> 306 tok/s
    "dsa_scores_tc": "EXL3TOOLS_DSA_SCORES_TC",
    # MoE prefill tiles of 64 rows on the shared-memory tile kernel (kernels/csrc tiles_body), the
    # tiles' padding rows skipped; 2026-12-02 H200, GLM-5 shape: one expert projection at 2048
    # tokens 6.81 -> 3.57 ms, the eager forward of a 2048-token prompt 112.6 -> 75.3 ms
    "prefill_tiles": "EXL3TOOLS_PREFILL_TILES",
    # MLA prompt attention without an (n, L) mask through flash attention where the value head is
    # smaller than the query's (DeepSeek-V3: 128 < 192): V decompressed with zero columns so the
    # three head sizes agree (MLAttention._sdpa_decompressed), not the memory-efficient kernel;
    # 2026-12-02 H200, DeepSeek-V3 shape: a 30000-token prompt through serve 3.59 -> 3.13 s
    # (exllamav3 2.46 s in the same run)
    "mla_flash_pad": "EXL3TOOLS_MLA_FLASH_PAD",
    # steps of more rows than the decode buckets (short prompts beside decoding rows, up to
    # PROMPT_GRAPH_ROWS) replay larger buckets of the fixed-shape step (runtime/paged_decode.py)
    # instead of the eager forward, whose fixed cost stalls every running stream; on CUDA only (the
    # CPU's static step keeps the eager forward unless "1"). 2026-12-02 H200, GLM-4.5-Air shape: 8
    # short prompts joining 8 streams at a 4096 context: the streams' longest gap 58 -> 18 ms,
    # the prompts' TTFT 143 -> 51 ms; 8 streams 2120 -> 2304 tok/s (exllamav3 1316)
    "prompt_graphs": "EXL3TOOLS_PROMPT_GRAPHS",
    # the MLA decode kernel on fp16 planes at 32 heads x 64 keys x 8 warps (16 heads below 32
    # heads) instead of 16 x 16 x 8 (kernels/mla_attention.default_config): 2.2-2.6x faster on the
    # H200 (128 heads: 222 -> 100 us at batch 1 and a 32k context, 825 -> 315 us at batch 32 and
    # 4k); DeepSeek-V3 shape, one stream at a 30000-token context 251 -> 298 tok/s through serve.
    # Its kernel tests pass on the H200 (2026-12-02, every tile against the oracle, the rows of one
    # sequence among them); the one fixture test it failed sat on a tie (docs/gpu.md)
    "mla_wide_tiles": "EXL3TOOLS_MLA_WIDE_TILES",
    # the MLA kernel's splits on fp16 planes' 32- and 64-head tiles (one program an SM: 115-221 KiB
    # of shared memory, ~240 registers a thread) fill whole waves (kernels/mla_attention
    # default_num_splits one_per_sm) instead of about two programs an SM. H200, the 2026-12-04 17:20
    # session (bench/gpu_mla_attention.py --sweep, 128 heads, 4k): batch 8 98.8-101.4 -> 78.6 us,
    # batch 32 283 -> 205 us; batch 1 unchanged (64 splits either way); tests/gpu passed with it
    # (876); DeepSeek-V3 shape served, 8 streams at a 4096-token context 1588 -> 1613 tok/s, 32 short
    # streams unchanged (2679 / 2677)
    "mla_wave_splits": "EXL3TOOLS_MLA_WAVE_SPLITS",
    # the prompt buckets' graphs and the decode buckets' in one graph memory pool (captured largest
    # first: the decode graphs reuse the prompt graphs' freed blocks) instead of a pool each, whose
    # sizes add up (bench/gpu_memory.py on the H200, 2026-12-02: GLM-5 shape with
    # --speculative-tokens 3, prompt pool 1.05 GB beside a decode pool of 2.23; without MTP 0.05-0.1
    # GB); a failed prompt capture drops the pool, so the decode graphs take a new one
    "shared_graph_pool": "EXL3TOOLS_SHARED_GRAPH_POOL",
    # CUDA only (on the CPU, the reference path, only when "1": on_cuda): a long prompt's DSA
    # selection through the decode step's kernels (Indexer.select_kernels: tensor-core scores over
    # fp16 keys, the Triton top-k, row groups of 128 MiB of scores) instead of float32 logits of
    # every row, head and key in ~60 row groups and a sort; and the prompt rows then attend over
    # their selected keys only (MLAttention.attend_selected: the decode step's MLA kernel, one row a
    # query, absorbed, as exllamav3's dsa_attn) instead of densely over the decompressed history
    # under the selection as a mask. H200, 2026-12-02 (bench/gpu_prefill.py --long 30000
    # --long-variants, GLM-5 shape, warm): a 30000-token prompt dense 5.63 s, with the kernels'
    # selection 4.39, sparse with the torch selection 6.22, sparse with the kernels' **2.51 s**
    # (the chunk at a 28672-token history 445 -> 145 ms; 1.74 s since mla.SELECT_TILE); through
    # serve, the server's first such prompt 3.42 s with the sparse rows off, 2.35 s on. (The earlier served 6.1 -> 9.5 s of the
    # kernels' selection was Triton compiling the chunked top-k afresh at every power of two of
    # the history: its count slots are now a fixed size.)
    "dsa_prefill_kernels": "EXL3TOOLS_DSA_PREFILL_KERNELS",
    "dsa_sparse_prefill": "EXL3TOOLS_DSA_SPARSE_PREFILL",
    # the 64-row MoE prefill tile kernel with the output Hadamard, svh and bias fused into it where
    # a launch takes one split (kernels/csrc tiles_epilogue): no fp32 workspace written, read and
    # re-zeroed, no had_out launch. H200, 2026-12-02 (bench/gpu_prefill.py --forwards-only, one
    # process per variant, same call): a 2048-token forward 47.6 -> 38.0 ms on the GLM-4.5-Air
    # shape, 66.9 -> 58.7 on GLM-5's (with dense_fold); one GLM-5 expert projection of 2048 tokens
    # 3.50 -> 2.87 ms (bench/gpu_moe_prefill.py); the step's activation peak 0.52 -> 0.45 GiB
    "tiles_epilogue": "EXL3TOOLS_TILES_EPILOGUE",
    # dense linears of 65-1024 rows (cuda_exl3.WGR_MAX_ROWS: prompt chunks, prompt-graph buckets,
    # decode batches past 64) of cuda_exl3.WGR_MIN_WEIGHTS (16 M) weights or more, in slots of 256
    # rows on exl3_wgr_rg_out_* (kernels/csrc/exl3_wgmma.cuh wgr_body: each warp decodes its tile
    # straight into the register A operand of an m64n256 wgmma; x and the trellis words come by TMA
    # into mbarrier stages from a producer warpgroup that gives its registers to the consumers; the
    # output pass in the epilogue writes y; a launch of too few tiles splits K, its splits meeting
    # in the kernel, each finishing a share of the rows in split order) instead of decode to fp16
    # + cuBLAS. H100, 2026-12-06 11:03 (bench/gpu_gemm_ab.py, graph replays, K 3, x fp16 cuBLAS
    # side by side): 256 rows 1.02-1.36x at 4096 -> 14336 / 14336 -> 4096 / 8192 -> 8192 / 4096 ->
    # 12288 / 12288 -> 4096 / 4096 -> 11008 / 11008 -> 4096 (1.12 / 1.09 / 1.25 / 1.28 / 1.11 / 1.36
    # / 1.02) against the default's 1.94-2.37x; 512 rows 1.25-1.82x against 1.83-1.92x; 1024 rows
    # 1.30-1.41x against 1.49-1.57x; tests/gpu 1167 passed with it on. Served (air6, the openai
    # client, four servers alternating on, off, on, off, 2026-12-06 11:40): a cold 1024-token prompt's
    # prefill step 40.5 / 32.1 ms against 49.6 / 53.2 (the server's own TTFT 42.6 / 34.0 against
    # 51.3 / 54.9); 2048-token prompts (one 2048-row step, past WGR_MAX_ROWS) and decode unchanged
    "dense_wgr": "EXL3TOOLS_DENSE_WGR",
    # the server's planner keeps a step that replays a prompt graph within the graphs' rows and
    # context reads: a prompt whose chunk would push it into the eager forward waits for the next
    # step (server/planner.py plan_step). H200, 2026-12-03 (bench/gpu_serve.py, GLM-4.5-Air shape, 4
    # client processes): a burst of 32 streams went from one eager step of 869 rows (51.8 ms) to
    # prompt graphs of 482 and 497 rows (16.0 and 17.2 ms): TTFT median 114 -> 77 ms, 32 streams
    # 5349 -> 5541 tok/s; tests/gpu 819 passed with it on
    "prompt_fit": "EXL3TOOLS_PROMPT_FIT",
    # MoE prefill tiles of 128 rows (runtime.layers.tile_rows: where 1.5x the mean pairs an expert
    # passes 64) on exl3_wgr_rg_out_m128_t2_* (kernels/csrc/exl3_wgmma.cuh wgr_body on 128-row slots,
    # wgmma.m64n128k16: each warp decodes its tile straight into the register A operand, the output
    # pass in the epilogue, padding rows never stored) instead of the 64-row mma.sync tile kernel
    # (CudaExperts.moe_wgr; every CUDA expert set has k and n in 128s; never in batch-invariant runs).
    # H100, 2026-12-06 16:56: one air6 expert projection of 2048 tokens 1.00 ms against the 64-row
    # tiles' 1.29 (bench/gpu_moe_prefill.py); a 2048-token air6 forward 38.62 / 38.82 -> 35.56 / 35.64
    # ms, its MoE layer 5.29 / 5.27 -> 4.51 / 4.56 ms (bench/gpu_prefill.py --forwards-only, one
    # process a variant, off / on / off / on); its route test passed in tests/gpu
    "moe_wgr": "EXL3TOOLS_MOE_WGR",
    # MLA decode attention over dense rows (no DSA selection) on fp16 planes (C 512, rope 64, heads
    # in 64s) through the CUDA kernel (kernels/csrc/mla_decode.cu, kernels/mla_cuda.py: the key
    # tiles by TMA tensor copies, two warpgroups' wgmma on each) instead of the Triton split kernel;
    # the same partials and merge. H200, 2026-12-04 evening (bench/gpu_mla_cuda.py, with the
    # merge): 128 heads batch 1 at 32k 73.5 -> 54.6 us, batch 8 at 32k 352 -> 234, batch 32 at 4k
    # 198 -> 133, 64 heads batch 1 at 32k 59.1 -> 48.7, batch 1 at 4k 32.7 -> 31.3; tests/gpu 912
    # passed with it on; DeepSeek-V3 shape served (gpu_serve.py, both configs in one run) one stream at a
    # 30000-token context 398 -> 414 tok/s, 8 streams there 1212 -> 1356, at 4096 432 / 1613 -> 438 /
    # 1654, short 442 / 1579 -> 445 / 1593
    "mla_cuda": "EXL3TOOLS_MLA_CUDA",
    # that kernel with each key tile's scores computed once, by one warpgroup, the two trading
    # their softmax state and probabilities through shared memory (kernels/csrc/mla_decode.cu
    # pp_body, FlashMLA's schedule) instead of both computing them (S is 69 % of a warpgroup's MMA
    # work a tile there). H200, 2026-12-04 night (bench/gpu_mla_cuda.py, with the merge, block size
    # 16): 128 heads batch 1 at 32k 53.9 -> 51.3 us, batch 8 at 32k 233.7 -> 204.3, batch 32 at 4k
    # 132.9 -> 118.8, 64 heads batch 1 at 32k 48.8 -> 46.1; the MLA tests/gpu passed with it on
    "mla_pingpong": "EXL3TOOLS_MLA_PINGPONG",
    # 3INST / MCG linears of up to 8 rows (a slot): the MMA adds the two fp16 halves of each hashed
    # state (the state's half2 as two k entries of the A fragment, each activation fed twice), not
    # two PRMTs and an HADD2 a pair of weights (kernels/csrc/exl3_gemv.cu HALVES; a build define, so
    # read when a module is first built or loaded: kernels/cuda_build.halves). The weight's sum is
    # then exact in fp32 instead of rounded to fp16 (batch-invariant runs keep the rounded sum).
    # sm_90a SASS of the 1-row kernel (K 3, 3INST): 1112 -> 992 instructions. H100, 2026-12-05
    # (bench/gpu_bench.py --graph, off / on / on / off in one call): 4096 -> 14336 K 3 one row 3INST
    # 35.4 -> 30.6 µs, MCG 33.9 -> 31.0 (MUL1's 29.9), 8 rows 35.9 -> 33.8 / 35.3 -> 33.7; 14336 ->
    # 4096 35.7 -> 30.9 / 33.6 -> 30.9; tests/gpu passed with it (1085)
    "gemv_halves": "EXL3TOOLS_GEMV_HALVES",
    # the ping-pong MLA kernel for head counts that are not a multiple of 64: a tensor-parallel
    # rank's share (DeepSeek-V3's 128 heads at TP 4 / 8: 32 / 16; GLM-5's 64 at TP 2 / 4: 32 / 16),
    # which otherwise take Triton's kernel. The last head block's rows past H are zero queries whose
    # outputs are not stored (pp_body PAD, mla_decode_pp_pad). H100, 2026-12-05 (bench/gpu_mla_cuda.py,
    # block size 16, 32k): 32 heads batch 1 / 8 58.2 / 180.5 -> 43.3 / 139.5 µs, 16 heads 48.2 /
    # 156.0 -> 42.3 / 136.6; tests/gpu passed with it (its pad cases at 16 / 32 / 96 heads)
    "mla_pad_heads": "EXL3TOOLS_MLA_PAD_HEADS",
    # the ping-pong MLA kernel in FlashMLA's order (pp_body PS, mla_decode_pp_ps): warpgroup 0 stores
    # P_A scaled to B's maxima, so warpgroup 1 rescales O_R once a pair and issues P_B V_B,R and P_A
    # V_A,R back to back, where the plain order rescales O_R between them and waits for the first.
    # H100, 2026-12-05 (bench/gpu_mla_cuda.py): 128 heads batch 8 at 32k 210.4 -> 195.4 µs, batch 32
    # at 4k 123.9 -> 119.7, batch 1 unchanged (51.0 / 50.8); DeepSeek-V3 shape served at a
    # 30000-token context, 8 streams 1434 -> 1457 tok/s, one stream 409 / 408
    "mla_scaled_p": "EXL3TOOLS_MLA_SCALED_P",
    # The five below became defaults WITHOUT a GPU run (2026-12-04 22:35, no machine lent): launch
    # cuts of computations checked equal on the Triton interpreter and compiled for sm_90
    # (bench/triton_sm90_check.py); "0" restores the launches before them, for the A/B the next
    # GPU session times and in case tests/gpu finds them wrong there.
    # A DSA decode step's selection: the indexer's keys and head weights from one GEMM
    # (Indexer.wkw; the weights rounded inside the score kernels) and, with the tensor-core scores
    # and the chunked top-k, the top-k's first pass (the key high bytes' histogram) inside the
    # scores kernel (kernels/dsa_indexer.select): 4 launches fewer a layer past index_topk ("0":
    # the weights' own GEMM and two casts, the histogram pass of its own)
    "dsa_fused_select": "EXL3TOOLS_DSA_FUSED_SELECT",
    # an MLA model's MoE router in the fused step: its logits of x and of x rounded to fp16
    # (Fp16ChoiceMoE's pick) from one GEMM over both, the rounded rows written by the residual
    # norm beside x (fused_decode.residual_rmsnorm with_fp16): 3 launches fewer a MoE layer ("0":
    # two GEMMs and two casts)
    "router_one_gemm": "EXL3TOOLS_ROUTER_ONE_GEMM",
    # the MTP head's draft steps (PagedDecoder.draft) through the fused step's glue around its block
    # (FusedMlaStep.draft: the fused norms, the MLA kernels, the routing kernel and grouped experts)
    # instead of the torch draft body (each RMSNorm, RoPE, cache write and the router as torch ops,
    # MoE.forward_static): one draft step of the glm5 fixture 153 -> 43 kernels
    # (bench/count_decode_kernels.py --draft), where a DeepSeek-V3-shape draft took ~1.9 ms on the
    # H200 against ~0.35 ms a main-model layer ("0": the torch body)
    "fused_draft": "EXL3TOOLS_FUSED_DRAFT",
    # greedy and Draw-sampled MTP drafts, at any TP (runtime/speculative.py _chain_depths): each
    # draft depth's tokens stay on the device and feed the next depth's fixed-shape step, where each
    # depth read its tokens back first (a sync a depth: the GPU idle while the host prepares the
    # next); the drafts stay on the device through the verify too (draft_device / verify_device;
    # a row of a smaller k padded to the largest) and the engine reads them with its verdicts in
    # one sync: a speculative round's k + 1 host reads become one. "0": a sync a depth, and the verify
    # after the drafts are read
    "chained_drafts": "EXL3TOOLS_CHAINED_DRAFTS",
    # a tensor-parallel rank's MoE in the fused step (outputs all-reduced; --moe tp or ep;
    # fused_step._moe_reduced): the routing kernel, the grouped experts and the rows' weighted sum
    # in one kernel before the all-reduce, the shared expert around it as MoE._finish, where
    # MoE.forward_static routes in ~15 torch ops and decodes one row per pair ("0": forward_static)
    "fused_tp_moe": "EXL3TOOLS_FUSED_TP_MOE",
    # MLA layers (DeepSeek-V3, GLM-5) hold W_UK and W_UV in fp16 (kv_b_proj's own values) instead of
    # float32, and the absorbed products of up to mla_absorb.WIDE_ROWS rows (the decode step's, the
    # eager rows') run through kernels/mla_absorb.py, which widens each weight and sums in float32
    # (more rows widen the weights for the float32 einsum): half the bytes a decode step reads for
    # them (67 -> 34 MB a DeepSeek-V3 layer at 128 heads, beside ~213 MB of its 3-bit weights) and
    # ~2 GB more KV on one GPU for a 61-layer model; attend_decompressed's fp16 copies become the
    # same tensors. On CUDA only ("0": float32); the CPU reference keeps float32 unless "1" (the
    # interpreter tests: tests/test_mla_absorb.py). H100, the 2026-12-07 23:34 session: tests/gpu
    # passed with it and mla_w16_vt on (1355 of 1364 in the first call's time, the other 9 in the
    # second: 0 failed); served on the DeepSeek-V3 shape, one run each, the float32 einsums / this
    # with IEEE dots / with tf32x3 dots (mla_absorb.DOT_BY_BLOCK): 1 stream 444 / 457 / 458 tok/s,
    # 8 streams 1511 / 1535 / 1554, one stream at a 4096-token context 439 / 456 / 456, a cold
    # 2048-token TTFT 109 / 103 / 92.7 ms; the GLM-5 shape (tf32x3): 503 / 527, 1765 / 1722, 470 /
    # 492, a cold TTFT (the server's own) 65.3 / 106 ms with every prompt row on the kernels, which
    # mla_absorb.WIDE_ROWS then sent back to the float32 einsum; with it (the same session's last
    # call, the MLA files of tests/gpu passed) GLM-5 against "0": 530 / 505, 1789 / 1692, 489 /
    # 471, a cold 2048-token prefill step 63.1 / 59.2 ms (docs/gpu.md "What is left", 10)
    "mla_w16": "EXL3TOOLS_MLA_W16",
    # with mla_w16: W_UV's fp16 copy stored (heads, latent, v) -- W_UV a (heads, v, latent) view of
    # it, v contiguous -- so the latent-to-value product reads whole rows of v as W_UK's does (at 8
    # rows W_UK's product took 24.0 µs against W_UV's 48.3 on the H100, the same bytes; the
    # 2026-12-07 14:47 session). The decompression reads the same storage through its transpose.
    # H100, the 17:29 and 23:34 sessions: W_UV^T at 8 rows 20.6 µs against W_UV's 48.0 (the einsum
    # 38.0); the served figures above are with it. On CUDA only, as mla_w16 ("0": (heads, v, latent))
    "mla_w16_vt": "EXL3TOOLS_MLA_W16_VT",
}


def _variable(name: str) -> str:
    return OPT_OUTS[name] if name in OPT_OUTS else SWITCHES[name]


def asked_for(name: str) -> bool:
    """Whether the variable of ``name`` (a preview or a former one) is "1": explicitly on."""
    return os.environ.get(_variable(name)) == "1"


def on_cuda(name: str, device) -> bool:
    """A former preview that is the default on CUDA (off there only when "0") and runs elsewhere
    (the CPU reference path, the interpreter tests) only when asked for ("1")."""
    return switched_on(name) if getattr(device, "type", device) == "cuda" else asked_for(name)


def switched_on(name: str) -> bool:
    """Whether the path ``name`` runs: a preview when asked for ("1"), a former one unless "0"."""
    if name in OPT_OUTS:
        return os.environ.get(OPT_OUTS[name]) != "0"
    return asked_for(name)
