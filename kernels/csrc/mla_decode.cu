// Paged MLA decode attention on Hopper's warpgroup MMA: the split kernel of kernels/mla_attention.py
// (same contract, partials and merge) for fp16 planes with latent C 512 and rope R 64, 64 heads a
// block. kernels/mla_cuda.py launches it; kernels/cuda_build.py compiles it for sm_90a.
//
// Why not Triton: its kernel holds one 8-warp program an SM (255 registers with spills, 221 KiB of
// shared memory) whose tile load, two dots, softmax and rescale make one dependent chain; ncu on
// the H200 (2026-12-04) found no eligible warp in 71.5 % of cycles at 128 heads, batch 1, 32k.
// Here two warpgroups share each staged tile: both compute the block's scores S (64 heads x 64
// keys, m64n64k16 from shared memory: the duplicated product costs less than trading row maxima
// between them), each keeps its own copy of the softmax state, and each multiplies the
// probabilities (straight from S's registers, mma's A fragment layout) by its half of the latent
// (m64n256k16, B N-major), so each thread holds 128 output accumulators, not 256. The next tile's
// cp.async copies run beside the MMAs of this one (two stages).
//
// Shared memory: the queries and two key tiles, each 64 rows x 576 halves in 8 x 8 core matrices:
// row r's 16-byte piece p (halves 8p..8p+7) at halves p * PIECE_STRIDE + (r / 8) * 64 + (r % 8) * 8.
// The scores read a tile K-major (N = keys: core matrices 128 B apart along the keys, 1040 B
// along the dims) and the latent product reads the same bytes N-major (N = dims: 1040 B apart,
// K = keys: 128 B apart), so one copy serves both MMAs. A piece column is 1024 B plus 16 of
// padding, so the eight pieces of one row land in eight different bank groups: a warp copies four
// rows x 128 contiguous bytes (whole global lines; 64-byte row pieces fetched each line twice from
// L2, H200 ncu 2026-12-04) without shared-memory bank conflicts.
//
// Status (H200, 2026-12-04 evening; docs/gpu.md): exact (tests/gpu/test_mla_attention.py), but
// 0.78-0.90x the Triton kernel's time, so it stays the EXL3TOOLS_MLA_CUDA preview. Its diagnostics
// (nvcc -D, bench/gpu_mla_cuda.py --defines): MLA_NO_MMA (copies alone) and MLA_NO_LOADS (MMAs
// alone on stale tiles) put each 64-key tile at ~6 us of copies and ~3.6 us of MMAs at 128 heads,
// batch 1, 32k: 16-byte cp.async of gathered rows moves ~10 GB/s an SM at one block an SM (the
// copies stall on the LSU queue, "lg throttle"). MLA_BULK_PROBE copies each key row through the
// TMA unit (cp.async.bulk) into a row-major stage instead, which wgmma cannot read: its copies
// alone take half the time (43.7 vs 67.6 us with the merge). The next step is TMA tensor copies
// (a tensor map over each plane, 16-row boxes: one cache block) into wgmma's 128-byte-swizzle
// layout, which both MMAs can read as this layout is read.
#include <cuda.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {
#include "sm90_async.cuh"

constexpr int HB = 64, TN = 64, C = 512, R = 64, D = C + R;
constexpr int PIECES = D / 8;                 // 16-byte pieces a row (72)
constexpr int PIECE_STRIDE = 8 * 64 + 8;      // halves between pieces p and p + 1 of the core matrices
constexpr int TILE = PIECES * PIECE_STRIDE;   // halves of a staged tile (and of the queries)
constexpr int CHUNK = TN * 64;                // mla_decode_tma: halves of a 64-row x 128-byte swizzled chunk
constexpr int CHUNKS = D / 64;                // ... 8 latent chunks and the rope's
constexpr int STILE = CHUNKS * CHUNK;         // ... halves of a tile (73728 bytes)
constexpr float NEG_INF = -__builtin_huge_valf();

__device__ __forceinline__ int core_at(int r, int p) { return p * PIECE_STRIDE + (r >> 3) * 64 + (r & 7) * 8; }
// 128-byte swizzle (TMA's CU_TENSOR_MAP_SWIZZLE_128B, wgmma's layout 1): row r's 16-byte piece p
// of a 1024-byte-aligned chunk at halves r * 64 + (p ^ r % 8) * 8
__device__ __forceinline__ int sw128_at(int r, int p) { return r * 64 + ((p ^ (r & 7)) << 3); }

__device__ __forceinline__ uint64_t smem_desc(const half* p, int lbo, int sbo) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    return (uint64_t)((s & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
__device__ __forceinline__ uint64_t sw128_desc(const half* p, int lbo, int sbo) { return smem_desc(p, lbo, sbo) | (1ull << 62); }

// 64 rows x 576 halves into the core-matrix layout: warp w copies rows 8w..8w+7, thread (w, lane)
// rows 8w + lane / 8 ("a") and 8w + 4 + lane / 8 ("b"), pieces 8q + lane % 8: one warp instruction
// is four rows x 128 bytes. Pieces 0-63 from the latent row, 64-71 from the rope row; rows that
// are not ``ok`` are zero-filled (unwritten cache slots may hold NaN).
struct RowSrc { const half* lat; const half* rope; bool ok; };

__device__ __forceinline__ void stage_rows(half* dst, const RowSrc& a, const RowSrc& b) {
    const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) * 8 + (lane >> 3), p0 = lane & 7;
#pragma unroll
    for (int q = 0; q < PIECES / 8; q++) {
        const int p = 8 * q + p0;
        cp_async16(dst + core_at(r, p), q < C / 64 ? a.lat + 8 * p : a.rope + 8 * (p - C / 8), a.ok);
        cp_async16(dst + core_at(r + 4, p), q < C / 64 ? b.lat + 8 * p : b.rope + 8 * (p - C / 8), b.ok);
    }
}

// the same rows into the 128-byte-swizzled chunks (chunk q: pieces 8q..8q+7) of mla_decode_tma
__device__ __forceinline__ void stage_rows_sw128(half* dst, const RowSrc& a, const RowSrc& b) {
    const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) * 8 + (lane >> 3), p = lane & 7;
#pragma unroll
    for (int q = 0; q < CHUNKS; q++) {
        cp_async16(dst + q * CHUNK + sw128_at(r, p), q < C / 64 ? a.lat + 64 * q + 8 * p : a.rope + 8 * p, a.ok);
        cp_async16(dst + q * CHUNK + sw128_at(r + 4, p), q < C / 64 ? b.lat + 64 * q + 8 * p : b.rope + 8 * p, b.ok);
    }
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// mbarriers and TMA tensor copies (mla_decode_tma)
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(uint64_t* bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_2d(half* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
                 : "memory");
}

// One tile's online softmax (base 2) and latent product, shared by both kernels. s: the scores of
// this warpgroup's copy of S (s[4j + e]: row g, key 8j + 2 t4 + e; s[4j + 2 + e]: row g + 8);
// key k is attended iff bit k of ``mask``; v_desc(kk): the latent rows 16kk..16kk+15 of this
// warpgroup's 256 columns as wgmma's N-major B operand.
struct SoftmaxState { float m0, m1, l0, l1; };

template <typename VDesc>
__device__ __forceinline__ void softmax_pv(float (&s)[32], uint64_t mask, float qk_scale, SoftmaxState& st,
                                           float (&o)[128], int t4, VDesc v_desc) {
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const bool v = (mask >> (8 * j + 2 * t4 + e)) & 1;
            s[4 * j + e] = v ? s[4 * j + e] * qk_scale : NEG_INF;
            s[4 * j + 2 + e] = v ? s[4 * j + 2 + e] * qk_scale : NEG_INF;
            mx0 = fmaxf(mx0, s[4 * j + e]);
            mx1 = fmaxf(mx1, s[4 * j + 2 + e]);
        }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
    }
    const float mn0 = fmaxf(st.m0, mx0), mn1 = fmaxf(st.m1, mx1);
    const float ms0 = mn0 == NEG_INF ? 0.f : mn0, ms1 = mn1 == NEG_INF ? 0.f : mn1;   // no NaN
    const float a0 = exp2f(st.m0 - ms0), a1 = exp2f(st.m1 - ms1);
    st.m0 = mn0;
    st.m1 = mn1;
    uint32_t pa[4][4];      // P as mma's A fragments, keys 16 ks .. 16 ks + 15
    float r0 = 0.f, r1 = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const float p00 = exp2f(s[4 * j] - ms0), p01 = exp2f(s[4 * j + 1] - ms0);
        const float p10 = exp2f(s[4 * j + 2] - ms1), p11 = exp2f(s[4 * j + 3] - ms1);
        r0 += p00 + p01;
        r1 += p10 + p11;
        pa[j >> 1][2 * (j & 1)] = pack_half2(p00, p01);
        pa[j >> 1][2 * (j & 1) + 1] = pack_half2(p10, p11);
    }
    st.l0 = st.l0 * a0 + r0;      // this thread's columns only: the quad sums them at the end
    st.l1 = st.l1 * a1 + r1;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        o[4 * j] *= a0;
        o[4 * j + 1] *= a0;
        o[4 * j + 2] *= a1;
        o[4 * j + 3] *= a1;
    }
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < TN / 16; kk++) wgmma_rs_m64n256k16_tb(o, pa[kk], v_desc(kk));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
}

// The normalised output (one split: out) or partial and lse (po, plse), as _mla_split_kernel.
__device__ __forceinline__ void store_rows(const float (&o)[128], SoftmaxState st, bool any, float* __restrict__ out,
                                           float* __restrict__ po, float* __restrict__ plse, size_t row0, int sp,
                                           int num_splits, bool direct) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        st.l0 += __shfl_xor_sync(0xffffffffu, st.l0, x);
        st.l1 += __shfl_xor_sync(0xffffffffu, st.l1, x);
    }
    const float i0 = st.l0 > 0.f ? 1.f / st.l0 : 1.f, i1 = st.l1 > 0.f ? 1.f / st.l1 : 1.f;
    const size_t r0 = row0 + 16 * (warp & 3) + g, r1 = r0 + 8;
    float* d0 = direct ? out + r0 * C : po + (r0 * num_splits + sp) * C;
    float* d1 = direct ? out + r1 * C : po + (r1 * num_splits + sp) * C;
    if (direct || any) {    // an empty split writes its lse (-inf) alone: the merge never reads its o
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const int c = 256 * wg + 8 * j + 2 * t4;
            *reinterpret_cast<float2*>(d0 + c) = make_float2(o[4 * j] * i0, o[4 * j + 1] * i0);
            *reinterpret_cast<float2*>(d1 + c) = make_float2(o[4 * j + 2] * i1, o[4 * j + 3] * i1);
        }
    }
    if (!direct && wg == 0 && t4 == 0) {
        plse[r0 * num_splits + sp] = st.l0 > 0.f ? st.m0 + log2f(st.l0) : NEG_INF;
        plse[r1 * num_splits + sp] = st.l1 > 0.f ? st.m1 + log2f(st.l1) : NEG_INF;
    }
}

}  // namespace

// grid (H / 64 x num_splits, B), 256 threads, 3 x 74880 + 16 bytes of dynamic shared memory.
// Block (hc + hchunks * sp, b): heads 64 hc.., tiles t0..t1 of row b (as _mla_split_kernel: tps
// tiles a split, at least min_tps). ``sel`` null: tokens 0..lens[b] - 1; else the K entries of
// sel's row b (entries < 0 or >= lens[b] skipped). direct: out (B, H, C) normalised; else the
// normalised partial po (B, H, splits, C) and its base-2 lse plse (B, H, splits), -inf (and no
// o) for an empty split.
extern "C" __global__ void __launch_bounds__(256, 1)
mla_decode_wg(const half* __restrict__ ql, const half* __restrict__ qp, const half* __restrict__ ckv,
              const half* __restrict__ kpe, const int* __restrict__ bt, const int* __restrict__ lens,
              const int* __restrict__ sel, float* __restrict__ out, float* __restrict__ po,
              float* __restrict__ plse, float qk_scale, int num_splits, int min_tps, int H, int K, int hchunks,
              int log2bs, int s_cb, int s_ct, int s_pb, int s_pt, int s_bt, int s_sel, int direct) {
    extern __shared__ __align__(128) half sm[];
    half* qs = sm;
    half* ks = sm + TILE;                                                   // two stages
    uint8_t* kmask = reinterpret_cast<uint8_t*>(sm + 3 * TILE);             // [stage][warp]: keys 8 warp + i
    const int hc = blockIdx.x % hchunks, sp = blockIdx.x / hchunks, b = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2, t4 = lane & 3;
    const int L = lens[b];
    const int n = sel ? K : L;
    const int ntiles = (n + TN - 1) / TN;
    const int tps = max((ntiles + num_splits - 1) / num_splits, min_tps);
    const int t0 = sp * tps, t1 = min(t0 + tps, ntiles);
    const int* bt_row = bt + (size_t)b * s_bt;
    const int* sel_row = sel ? sel + (size_t)b * s_sel : nullptr;

    // this thread's two rows (stage_rows) of tile it; the table is read a tile ahead of the
    // copies, so its latency runs beside the MMAs, not before each tile's copies
    const int ra = warp * 8 + (lane >> 3);
    auto locate = [&](int it, int r) -> RowSrc {
        const int e = it * TN + r;
        int t = e;
        bool ok = e < L;
        if (sel_row) {
            t = e < K ? sel_row[e] : -1;
            ok = t >= 0 && t < L;
        }
        // past-the-end and skipped entries never dereference a table entry
        const int64_t blk = ok ? (int64_t)bt_row[t >> log2bs] : 0;
        const int64_t slot = ok ? (t & ((1 << log2bs) - 1)) : 0;
        return {ckv + blk * s_cb + slot * s_ct, kpe + blk * s_pb + slot * s_pt, ok};
    };
    auto load_tile = [&](const RowSrc& a, const RowSrc& b, int st) {
        stage_rows(ks + st * TILE, a, b);
        // key 8 warp + i valid: bit i (rows "a" of lanes 0, 8, 16, 24, then rows "b")
        const unsigned ma = __ballot_sync(0xffffffffu, a.ok), mb = __ballot_sync(0xffffffffu, b.ok);
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) m |= ((ma >> (8 * i)) & 1u) << i | ((mb >> (8 * i)) & 1u) << (4 + i);
        if (lane == 0) kmask[st * 8 + warp] = (uint8_t)m;
    };

    float o[128];                                    // O[64 heads, latent 256 wg .. 256 wg + 255]
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.f;
    SoftmaxState sm_st{NEG_INF, NEG_INF, 0.f, 0.f};   // rows g and g + 8 of this warp's 16

    if (t1 > t0) {
        const size_t qa = (size_t)b * H + hc * HB + ra, qb = qa + 4;
        stage_rows(qs, {ql + qa * C, qp + qa * R, true}, {ql + qb * C, qp + qb * R, true});
        load_tile(locate(t0, ra), locate(t0, ra + 4), 0);
        cp_async_commit();
        RowSrc na = locate(min(t0 + 1, t1 - 1), ra), nb = locate(min(t0 + 1, t1 - 1), ra + 4);
        for (int it = t0; it < t1; it++) {
            const int st = (it - t0) & 1;
            cp_async_wait<0>();
            fence_async_smem();
            __syncthreads();        // tile it staged; every warp done with tile it - 1 (stage st ^ 1)
#ifdef MLA_NO_LOADS
            if (it + 1 < t1 && it == t0) load_tile(na, nb, st ^ 1);
#else
            if (it + 1 < t1) load_tile(na, nb, st ^ 1);
#endif
            if (it + 2 < t1) {
                na = locate(it + 2, ra);
                nb = locate(it + 2, ra + 4);
            }
            cp_async_commit();
#ifdef MLA_NO_MMA
            continue;
#endif
            const half* kt = ks + st * TILE;
            float s[32];
#pragma unroll
            for (int i = 0; i < 32; i++) s[i] = 0.f;
            fence_regs(s);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_ss_m64n64k16(s, smem_desc(qs + 2 * kk * PIECE_STRIDE, 2 * PIECE_STRIDE, 128),
                                   smem_desc(kt + 2 * kk * PIECE_STRIDE, 2 * PIECE_STRIDE, 128));
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(s);
            softmax_pv(s, *reinterpret_cast<const uint64_t*>(kmask + st * 8), qk_scale, sm_st, o, t4,
                       [&](int kk) { return smem_desc(kt + 32 * wg * PIECE_STRIDE + 2 * kk * 64, 128, 2 * PIECE_STRIDE); });
        }
    }
    store_rows(o, sm_st, t1 > t0, out, po, plse, (size_t)b * H + hc * HB, sp, num_splits, direct);
}

// Dense rows (no selection) with the key tiles copied by the TMA unit: ``tm_ckv`` / ``tm_kpe`` are
// 2-D tensor maps over the planes as (slots, 512) / (slots, 64) fp16 rows, boxes of ``box_rows``
// (min(block_size, 64)) rows x 64 columns, 128-byte swizzle (kernels/mla_cuda.tensor_map). A tile
// is 9 chunks (8 latent, the rope) of 64 rows x 128 bytes; lanes 0..64/box_rows-1 of warp 0 each
// copy one table block's rows of all 9 chunks (box_rows x 1152 bytes) and arrive on the stage's
// mbarrier with their byte count. The queries go in by cp.async in the same swizzled layout.
// Scores: K-major, 128-byte swizzle (the k16 steps 32 bytes apart inside a chunk, SBO 1024 B); the
// latent product reads the chunks N-major (LBO 8192 B between 64-column chunks, SBO 1024 B
// between 8-key groups). Keys past the row's length are zeroed in shared memory after their tile
// lands (unused slots of its last block may hold NaN; whole boxes past it are never copied).
// grid and contract as mla_decode_wg; 3 x 73728 + 1024 + 16 bytes of dynamic shared memory.
#ifndef MLA_V_LBO
#define MLA_V_LBO (2 * CHUNK)
#define MLA_V_SBO 1024
#endif
extern "C" __global__ void __launch_bounds__(256, 1)
mla_decode_tma(const half* __restrict__ ql, const half* __restrict__ qp, const __grid_constant__ CUtensorMap tm_ckv,
               const __grid_constant__ CUtensorMap tm_kpe, const int* __restrict__ bt, const int* __restrict__ lens,
               float* __restrict__ out, float* __restrict__ po, float* __restrict__ plse, float qk_scale,
               int num_splits, int min_tps, int H, int hchunks, int log2bs, int box_rows, int s_bt, int direct) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    half* qs = reinterpret_cast<half*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    half* ks = qs + STILE;                                                  // two stages
    uint64_t* bars = reinterpret_cast<uint64_t*>(ks + 2 * STILE);           // a stage's copies landed
    const int hc = blockIdx.x % hchunks, sp = blockIdx.x / hchunks, b = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2, t4 = lane & 3;
    const int L = lens[b];
    const int ntiles = (L + TN - 1) / TN;
    const int tps = max((ntiles + num_splits - 1) / num_splits, min_tps);
    const int t0 = sp * tps, t1 = min(t0 + tps, ntiles);
    const int* bt_row = bt + (size_t)b * s_bt;
    const int boxes = TN / box_rows;
    const bool copier = warp == 0 && lane < boxes;      // lane j copies rows j box_rows.. of each tile

    // the first slot of this lane's box of tile it, or -1 past the row (its table entry unread)
    auto box_slot = [&](int it) -> int {
        const int e = it * TN + lane * box_rows;
        return e < L ? bt_row[e >> log2bs] * (1 << log2bs) + (e & ((1 << log2bs) - 1)) : -1;
    };
    auto copy_tile = [&](int slot, int st) {
        uint64_t* bar = bars + st;
        half* dst = ks + st * STILE + lane * box_rows * 64;
        if (slot < 0) {
            mbar_arrive_tx(bar, 0);
            return;
        }
        mbar_arrive_tx(bar, box_rows * D * 2);
#pragma unroll
        for (int q = 0; q < C / 64; q++) tma_2d(dst + q * CHUNK, &tm_ckv, 64 * q, slot, bar);
        tma_2d(dst + (C / 64) * CHUNK, &tm_kpe, 0, slot, bar);
    };

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.f;
    SoftmaxState sm_st{NEG_INF, NEG_INF, 0.f, 0.f};

    if (t1 > t0) {
        if (threadIdx.x == 0) {
            mbar_init(bars, boxes);
            mbar_init(bars + 1, boxes);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        __syncthreads();
        const int ra = warp * 8 + (lane >> 3);
        const size_t qa = (size_t)b * H + hc * HB + ra, qb = qa + 4;
        stage_rows_sw128(qs, {ql + qa * C, qp + qa * R, true}, {ql + qb * C, qp + qb * R, true});
        cp_async_commit();
        int next = -1;
        if (copier) {
            copy_tile(box_slot(t0), 0);
            if (t0 + 1 < t1) next = box_slot(t0 + 1);
        }
        for (int it = t0; it < t1; it++) {
            const int st = (it - t0) & 1;
            half* kt = ks + st * STILE;
            cp_async_wait<0>();                         // the queries (first tile)
            mbar_wait(bars + st, ((it - t0) >> 1) & 1);
            const int valid = L - it * TN;
            if (valid < TN) {     // the row's last tile: zero the rows past its length, every chunk
                for (int i = threadIdx.x; i < (TN - valid) * CHUNKS * 8; i += 256) {
                    const int r = valid + i / (CHUNKS * 8), q = (i / 8) % CHUNKS, pc = i % 8;
                    *reinterpret_cast<uint4*>(kt + q * CHUNK + r * 64 + pc * 8) = make_uint4(0, 0, 0, 0);
                }
            }
            fence_async_smem();
            __syncthreads();      // tile it is here; every warp is done with tile it - 1 (stage st ^ 1)
            if (copier && it + 1 < t1) {
                copy_tile(next, st ^ 1);
                if (it + 2 < t1) next = box_slot(it + 2);
            }
            float s[32];
#pragma unroll
            for (int i = 0; i < 32; i++) s[i] = 0.f;
            fence_regs(s);
            wgmma_fence();
#pragma unroll
            for (int q = 0; q < CHUNKS; q++)
#pragma unroll
                for (int k4 = 0; k4 < 4; k4++)
                    wgmma_ss_m64n64k16(s, sw128_desc(qs + q * CHUNK + 16 * k4, 16, 1024),
                                       sw128_desc(kt + q * CHUNK + 16 * k4, 16, 1024));
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(s);
            const uint64_t mask = valid >= TN ? ~0ull : (1ull << valid) - 1;
            softmax_pv(s, mask, qk_scale, sm_st, o, t4,
                       [&](int kk) { return sw128_desc(kt + 4 * wg * CHUNK + kk * 16 * 64, MLA_V_LBO, MLA_V_SBO); });
        }
    }
    store_rows(o, sm_st, t1 > t0, out, po, plse, (size_t)b * H + hc * HB, sp, num_splits, direct);
}
