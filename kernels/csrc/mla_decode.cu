// Paged MLA decode attention on Hopper: the split kernel of kernels/mla_attention.py (same contract,
// partials and merge) for dense rows (no DSA selection) on fp16 planes with latent C 512 and rope R
// 64, 64 heads a block, the key tiles copied by the TMA unit and multiplied on warpgroup MMAs.
// kernels/mla_cuda.py launches it; kernels/cuda_build.py compiles it for sm_90a.
//
// Why not Triton: its kernel holds one 8-warp program an SM (255 registers with spills, 221 KiB of
// shared memory) whose tile load, two dots, softmax and rescale make one dependent chain; ncu on
// the H200 (2026-12-04) found no eligible warp in 71.5 % of cycles at 128 heads, batch 1, 32k.
// Here two warpgroups share each staged tile. In tma_body both compute the block's scores S (64
// heads x 64 keys, m64n64k16 from shared memory), each keeps its own copy of the softmax state, and
// each multiplies the probabilities (straight from S's registers, mma's A fragment layout) by its
// half of the latent (m64n256k16, B N-major), so each thread holds 128 output accumulators, not
// 256. The next tile's
// copies run beside the MMAs of this one (two stages). pp_body (below; the default, mla_cuda.split
// pingpong) computes each tile's scores once and trades the softmax state between the warpgroups:
// 12 % faster at 128 heads, batch 8, 32k on the H200, where the copies, not the MMAs, bound both.
//
// Why TMA: a first version copied the gathered key rows with 16-byte cp.async (H200, 2026-12-04
// evening, docs/gpu.md): exact, but 0.87-0.91x Triton's time. Timed apart (with the MMAs, or the
// copies, compiled out), a 64-key tile took ~6 us of copies and ~3.6 us of MMAs at 128 heads,
// batch 1, 32k: 16-byte copies of gathered rows moved ~10 GB/s an SM at one block an SM, stalled
// on the LSU's queue; each row through the TMA unit (cp.async.bulk) halved the copies' time. So the
// tiles come as TMA tensor copies: a table block's rows of each 64-column chunk, one instruction.
//
// Shared memory: the queries and two key tiles, each 9 chunks (8 latent, the rope) of 64 rows x
// 128 bytes in the 128-byte swizzle (row r's 16-byte piece p at (p ^ r % 8) of the row, chunks
// 1024-byte aligned) that TMA writes and wgmma reads: the scores K-major (the k16 steps 32 bytes
// apart inside a chunk, 1024 bytes between 8-row groups), the latent product the same bytes
// N-major (8192 bytes between 64-column chunks, 1024 between 8-key groups). Swapping those two
// offsets gives errors of ~1 (H200), so the layout is the one the hardware reads.
#include <cuda.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {
#include "sm90_async.cuh"

constexpr int HB = 64, TN = 64, C = 512, R = 64, D = C + R;
constexpr int CHUNK = TN * 64;                // halves of a 64-row x 128-byte swizzled chunk
constexpr int CHUNKS = D / 64;                // 8 latent chunks and the rope's
constexpr int STILE = CHUNKS * CHUNK;         // halves of a tile (73728 bytes)
constexpr float NEG_INF = -__builtin_huge_valf();

// 64 rows x 576 halves (the queries) into the 128-byte-swizzled chunks (chunk q: halves
// 64q..64q+63 of each row): warp w copies rows 8w..8w+7, thread (w, lane) rows 8w + lane / 8 ("a")
// and 8w + 4 + lane / 8 ("b"), piece lane % 8 of each chunk, so one warp instruction is four rows
// x 128 contiguous bytes; chunks 0-7 from the latent row, 8 from the rope row.
struct RowSrc { const half* lat; const half* rope; };

// ``pa`` / ``pb`` false: that row is zero-filled (a padded head: pp_body's PAD), its source unread.
__device__ __forceinline__ void stage_rows_sw128(half* dst, const RowSrc& a, const RowSrc& b, bool pa = true,
                                                 bool pb = true) {
    const int lane = threadIdx.x & 31, r = (threadIdx.x >> 5) * 8 + (lane >> 3), p = lane & 7;
#pragma unroll
    for (int q = 0; q < CHUNKS; q++) {
        cp_async16(dst + q * CHUNK + sw128_at(r, p), q < C / 64 ? a.lat + 64 * q + 8 * p : a.rope + 8 * p, pa);
        cp_async16(dst + q * CHUNK + sw128_at(r + 4, p), q < C / 64 ? b.lat + 64 * q + 8 * p : b.rope + 8 * p, pb);
    }
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// The first slot of a copier lane's box (``box_rows`` keys from key ``e``) of row ``bt_row`` (L keys,
// blocks of 1 << log2bs slots), or -1 past the row (its table entry unread)
__device__ __forceinline__ int box_slot_at(const int* __restrict__ bt_row, int e, int L, int log2bs) {
    return e < L ? bt_row[e >> log2bs] * (1 << log2bs) + (e & ((1 << log2bs) - 1)) : -1;
}

// One tile's online softmax (base 2) and latent product. s: the scores of
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
    for (int kk = 0; kk < TN / 16; kk++) wgmma_m64n256k16<1>(o, pa[kk], v_desc(kk));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
}

// The normalised output (one split: out) or partial and lse (po, plse), as _mla_split_kernel.
// PAD: only the block's first ``nh`` rows are heads (the rest padding: nothing stored).
template <bool PAD = false>
__device__ __forceinline__ void store_rows(const float (&o)[128], SoftmaxState st, bool any, float* __restrict__ out,
                                           float* __restrict__ po, float* __restrict__ plse, size_t row0, int sp,
                                           int num_splits, bool direct, int nh = 64) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2, g = lane >> 2, t4 = lane & 3;
    const bool w0 = !PAD || 16 * (warp & 3) + g < nh, w1 = !PAD || 16 * (warp & 3) + g + 8 < nh;
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
            if (w0) *reinterpret_cast<float2*>(d0 + c) = make_float2(o[4 * j] * i0, o[4 * j + 1] * i0);
            if (w1) *reinterpret_cast<float2*>(d1 + c) = make_float2(o[4 * j + 2] * i1, o[4 * j + 3] * i1);
        }
    }
    if (!direct && wg == 0 && t4 == 0) {
        if (w0) plse[r0 * num_splits + sp] = st.l0 > 0.f ? st.m0 + log2f(st.l0) : NEG_INF;
        if (w1) plse[r1 * num_splits + sp] = st.l1 > 0.f ? st.m1 + log2f(st.l1) : NEG_INF;
    }
}

}  // namespace

// Dense rows (no selection) with the key tiles copied by the TMA unit: ``tm_ckv`` / ``tm_kpe`` are
// 2-D tensor maps over the planes as (slots, 512) / (slots, 64) fp16 rows, boxes of ``box_rows``
// (min(block_size, 64)) rows x 64 columns, 128-byte swizzle (cuda_driver.tensor_map_2d, mla_cuda._plane_map). A tile
// is 9 chunks (8 latent, the rope) of 64 rows x 128 bytes; lanes 0..64/box_rows-1 of warp 0 each
// copy one table block's rows of all 9 chunks (box_rows x 1152 bytes) and arrive on the stage's
// mbarrier with their byte count. The queries go in by cp.async in the same swizzled layout.
// Scores: K-major, 128-byte swizzle (the k16 steps 32 bytes apart inside a chunk, SBO 1024 B); the
// latent product reads the chunks N-major (LBO 8192 B between 64-column chunks, SBO 1024 B
// between 8-key groups). Keys past the row's length are zeroed in shared memory after their tile
// lands (unused slots of its last block may hold NaN; whole boxes past it are never copied).
// grid (H / 64 x num_splits, B), 256 threads, 3 x 73728 + 1024 + 16 bytes of dynamic shared memory.
// Block (hc + hchunks * sp, b): heads 64 hc.., tiles t0..t1 of row b (as _mla_split_kernel: tps
// tiles a split, at least min_tps), tokens 0..lens[b] - 1. direct: out (B, H, C) normalised; else
// the normalised partial po (B, H, splits, C) and its base-2 lse plse (B, H, splits), -inf (and no
// o) for an empty split.
__device__ __forceinline__ void tma_body(const half* __restrict__ ql, const half* __restrict__ qp,
                                         const CUtensorMap& tm_ckv, const CUtensorMap& tm_kpe,
                                         const int* __restrict__ bt, const int* __restrict__ lens,
                                         float* __restrict__ out, float* __restrict__ po, float* __restrict__ plse,
                                         float qk_scale, int num_splits, int min_tps, int H, int hchunks, int log2bs,
                                         int box_rows, int s_bt, int direct) {
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

    auto box_slot = [&](int it) { return box_slot_at(bt_row, it * TN + lane * box_rows, L, log2bs); };
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
        stage_rows_sw128(qs, {ql + qa * C, qp + qa * R}, {ql + qb * C, qp + qb * R});
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
                       [&](int kk) { return sw128_desc(kt + 4 * wg * CHUNK + kk * 16 * 64, 2 * CHUNK, 1024); });
        }
    }
    store_rows(o, sm_st, t1 > t0, out, po, plse, (size_t)b * H + hc * HB, sp, num_splits, direct);
}

// A body's entry point (the bodies take the same arguments; the body a variadic argument: pp_body<PAD, PS>)
#define MLA_ENTRY_POINT(NAME, ...)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                         \
        NAME(const half* __restrict__ ql, const half* __restrict__ qp, const __grid_constant__ CUtensorMap tm_ckv, \
             const __grid_constant__ CUtensorMap tm_kpe, const int* __restrict__ bt, const int* __restrict__ lens,  \
             float* __restrict__ out, float* __restrict__ po, float* __restrict__ plse, float qk_scale,             \
             int num_splits, int min_tps, int H, int hchunks, int log2bs, int box_rows, int s_bt, int direct) {      \
        __VA_ARGS__(ql, qp, tm_ckv, tm_kpe, bt, lens, out, po, plse, qk_scale, num_splits, min_tps, H, hchunks,   \
                    log2bs, box_rows, s_bt, direct);                                                             \
    }
MLA_ENTRY_POINT(mla_decode_tma, tma_body)

// ---- Ping-pong: each tile's scores computed once (the default; EXL3TOOLS_MLA_PINGPONG=0 opts out) ----
//
// mla_decode_tma has both warpgroups compute every tile's scores: at 576-wide keys S is 69 % of a
// warpgroup's MMA work (4.7 of 6.8 MFLOP a tile), so duplicating it costs half again the MMAs.
// Here the block takes its tiles in pairs (A in key buffer 0, B in buffer 1): warpgroup 0 computes
// S of A, warpgroup 1 S of B, and they trade the softmax state through shared memory (FlashMLA's
// "seesaw" on Hopper, github.com/deepseek-ai/FlashMLA, read for the schedule, not copied):
//   WG0: S_A; M0 = max(M, rowmax S_A); scale0 = 2^(M - M0); P_A -> smem; [M0, scale0, P_A ready];
//        O_L *= scale0; O_L += P_A V_A,L (P from registers); [wait scale1]; O_L *= scale1;
//        [wait P_B]; O_L += P_B V_B,L (P from shared memory)
//   WG1: S_B; [wait M0, scale0, P_A]; O_R *= scale0; O_R += P_A V_A,R (from shared memory), beside
//        M1 = max(M0, rowmax S_B); scale1 = 2^(M0 - M1); P_B; [scale1 ready]; P_B -> smem;
//        [P_B ready]; O_R *= scale1; O_R += P_B V_B,R (from registers)
// so one warpgroup's softmax runs beside the other's MMAs, and A's buffer is free mid-pair (the
// next A lands while B is multiplied). Each P (64 heads x 64 keys fp16, one
// 128-byte-swizzled chunk) overwrites its tile's rope chunk, which only that tile's S read: shared
// memory stays the queries and two tiles. Each chunk of a buffer has its own mbarrier, so S starts
// on the first chunks while the last land, and each chunk is refilled as soon as its last reader
// is done: WG0 refills chunks 0-3 of both buffers (V_L) and B's rope chunk (P_B, which WG0
// reads), WG1 chunks 4-7 of both (V_R) and A's rope chunk (P_A).
constexpr int PP_M = 0, PP_SCALE0 = HB, PP_SCALE1 = 2 * HB, PP_L = 3 * HB, PP_FLOATS = 5 * HB;
enum : int { BAR_SCALE0 = 1, BAR_SCALE1 = 2, BAR_P1 = 3, BAR_WG = 4 };   // BAR_WG + wg: one warpgroup
constexpr int BAR_P0 = 6;      // PS: P_A at B's maxima in shared memory

// rows valid..TN-1 of chunks q0..q1-1 of a key buffer to zero (a row's last tile: unused slots of
// its last block may hold NaN, and 0 x NaN would reach O), by the 128 threads of one warpgroup
__device__ __forceinline__ void zero_rows(half* kt, int valid, int q0, int q1, int wtid, int wg) {
    const int per_row = (q1 - q0) * 8;
    for (int i = wtid; i < (TN - valid) * per_row; i += 128) {
        const int r = valid + i / per_row, q = q0 + (i / 8) % (q1 - q0), pc = i % 8;
        *reinterpret_cast<uint4*>(kt + q * CHUNK + r * 64 + pc * 8) = make_uint4(0, 0, 0, 0);
    }
    fence_async_smem();
    named_sync(BAR_WG + wg, 128);
}

// P (s, already exponentiated; rows r0 and r0 + 8) as fp16 into a 128-byte-swizzled chunk,
// K-major: the A operand of the other warpgroup's latent product
__device__ __forceinline__ void store_p(half* chunk, const float (&s)[32], int r0, int t4) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        *reinterpret_cast<uint32_t*>(chunk + sw128_at(r0, j) + 2 * t4) = pack_half2(s[4 * j], s[4 * j + 1]);
        *reinterpret_cast<uint32_t*>(chunk + sw128_at(r0 + 8, j) + 2 * t4) = pack_half2(s[4 * j + 2], s[4 * j + 3]);
    }
}

// Descriptor arithmetic: a descriptor's start address is its bits 0-13 in 16-byte units, so a
// chunk (8192 bytes) is +512, a k16 step inside a 128-byte row +2, a 16-key step down the latent
// (N-major, 2048 bytes) +128 and the other warpgroup's half of it (4 chunks) +2048; built once,
// added to per MMA (the uniform-datapath ops that rebuilt each one were ~16 % of the ncu stall
// samples, H200 2026-12-04 night).
constexpr uint64_t D_CHUNK = CHUNK * 2 / 16, D_K16 = 2, D_V16 = 16 * 64 * 2 / 16, D_VHALF = 4 * D_CHUNK;

// S = Q K^T of one buffered tile (m64n64k16 over its 9 chunks, each once its mbarrier completes):
// dq / dk the K-major descriptors of the queries and the tile
__device__ __forceinline__ void scores(float (&s)[32], uint64_t dq, uint64_t dk, uint64_t* bars, int parity) {
#pragma unroll
    for (int i = 0; i < 32; i++) s[i] = 0.f;
    fence_regs(s);
#pragma unroll
    for (int q = 0; q < CHUNKS; q++) {      // a commit group a chunk: the wait loop sits outside the MMAs
        mbar_wait(bars + q, parity);
        wgmma_fence();
#pragma unroll
        for (int k4 = 0; k4 < 4; k4++) wgmma_ss_m64n64k16(s, dq + q * D_CHUNK + k4 * D_K16, dk + q * D_CHUNK + k4 * D_K16);
        wgmma_commit();
    }
    wgmma_wait<0>();
    fence_regs(s);
}

// masked, scaled to base 2, and the rows' maxima over the quad (mx0: row g, mx1: row g + 8)
__device__ __forceinline__ void mask_rowmax(float (&s)[32], int valid, float qk_scale, int t4, float& mx0, float& mx1) {
    mx0 = mx1 = NEG_INF;
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const bool v = 8 * j + 2 * t4 + e < valid;
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
}

// s <- 2^(s - m) (m -inf: 0, no NaN) and, packed, P as mma's A fragments; returns this thread's row sums
__device__ __forceinline__ void exp_pack(float (&s)[32], float m0, float m1, uint32_t (&pa)[4][4], float& r0, float& r1) {
    const float ms0 = m0 == NEG_INF ? 0.f : m0, ms1 = m1 == NEG_INF ? 0.f : m1;
    r0 = r1 = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        s[4 * j] = exp2f(s[4 * j] - ms0);
        s[4 * j + 1] = exp2f(s[4 * j + 1] - ms0);
        s[4 * j + 2] = exp2f(s[4 * j + 2] - ms1);
        s[4 * j + 3] = exp2f(s[4 * j + 3] - ms1);
        r0 += s[4 * j] + s[4 * j + 1];
        r1 += s[4 * j + 2] + s[4 * j + 3];
        pa[j >> 1][2 * (j & 1)] = pack_half2(s[4 * j], s[4 * j + 1]);
        pa[j >> 1][2 * (j & 1) + 1] = pack_half2(s[4 * j + 2], s[4 * j + 3]);
    }
}

// rows r0 (s[4j], s[4j + 1]) and r0 + 8 (s[4j + 2], s[4j + 3]) of P times f0 / f1
__device__ __forceinline__ void scale_p(float (&s)[32], float f0, float f1) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        s[4 * j] *= f0;
        s[4 * j + 1] *= f0;
        s[4 * j + 2] *= f1;
        s[4 * j + 3] *= f1;
    }
}

__device__ __forceinline__ float rescale_from(float m_old, float m_new) {
    return exp2f(m_old - (m_new == NEG_INF ? 0.f : m_new));      // m_old -inf: 0
}
__device__ __forceinline__ void scale_o(float (&o)[128], float f0, float f1) {
    // past the first tiles the maxima rarely move: a warp whose factors are all 1 skips the 128
    // multiplies (FMUL was 9 % of the stall samples)
    if (!__any_sync(0xffffffffu, f0 != 1.f || f1 != 1.f)) return;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        o[4 * j] *= f0;
        o[4 * j + 1] *= f0;
        o[4 * j + 2] *= f1;
        o[4 * j + 3] *= f1;
    }
}

// Same contract, grid and arguments as tma_body; 3 x 73728 + 1024 + 5 x 64 x 4 + 18 x 8 bytes of
// dynamic shared memory (mla_cuda.SMEM_PP). PAD (mla_decode_pp_pad, EXL3TOOLS_MLA_PAD_HEADS): H
// need not be a multiple of 64 (a tensor-parallel rank's 16 or 32 heads): the last head block's
// rows past H are zero queries, whose outputs are not stored (the MMAs cost what 64 heads cost;
// the key copies, the bound, too).
// PS (mla_decode_pp_ps, EXL3TOOLS_MLA_SCALED_P; FlashMLA's order, read, not copied):
// warpgroup 0 stores P_A only once B's maxima are known, scaled to them, so warpgroup 1 rescales
// O_R once a pair (by scale0 x scale1) and issues its two latent products back to back, P_B V_B,R
// from registers first, where the plain order (EXL3TOOLS_MLA_SCALED_P=0) rescales O_R between them
// and waits for the first:
//   WG0: S_A; softmax; [M0, scale0]; O_L *= scale0; O_L += P_A V_A,L; [wait scale1];
//        P_A *= scale1 -> smem; [P_A ready]; O_L *= scale1; [wait P_B]; O_L += P_B V_B,L
//   WG1: S_B; [wait M0, scale0]; M1, scale1, P_B; [scale1 ready]; O_R *= scale0 x scale1;
//        P_B -> smem; [P_B ready]; O_R += P_B V_B,R; [wait P_A]; O_R += P_A V_A,R
template <bool PAD = false, bool PS = false>
__device__ __forceinline__ void pp_body(const half* __restrict__ ql, const half* __restrict__ qp,
                                        const CUtensorMap& tm_ckv, const CUtensorMap& tm_kpe,
                                        const int* __restrict__ bt, const int* __restrict__ lens,
                                        float* __restrict__ out, float* __restrict__ po, float* __restrict__ plse,
                                        float qk_scale, int num_splits, int min_tps, int H, int hchunks, int log2bs,
                                        int box_rows, int s_bt, int direct) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    half* qs = reinterpret_cast<half*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    half* ks = qs + STILE;                                                  // buffers 0 (A) and 1 (B)
    float* sc = reinterpret_cast<float*>(ks + 2 * STILE);                   // M, scale0, scale1, l of both
    uint64_t* bars = reinterpret_cast<uint64_t*>(sc + PP_FLOATS);           // [buffer][chunk]
    const int hc = blockIdx.x % hchunks, sp = blockIdx.x / hchunks, b = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2, t4 = lane & 3;
    const int wtid = threadIdx.x & 127, r0 = 16 * (warp & 3) + (lane >> 2), r1 = r0 + 8;
    const int nh = PAD ? min(HB, H - hc * HB) : HB;          // this block's heads
    const int L = lens[b];
    const int ntiles = (L + TN - 1) / TN;
    const int tps = max((ntiles + num_splits - 1) / num_splits, min_tps);
    const int t0 = sp * tps, t1 = min(t0 + tps, ntiles);
    const int* bt_row = bt + (size_t)b * s_bt;
    const int boxes = TN / box_rows;
    const bool copier = (warp & 3) == 0 && lane < boxes;   // each warpgroup's first warp: lane j, box j

    auto box_slot = [&](int it) { return box_slot_at(bt_row, it * TN + lane * box_rows, L, log2bs); };
    // chunks q0..q1-1 of tile ``it`` into buffer ``buf``: each copier lane its box (one table
    // block's rows) of each chunk; a box past the row arrives with no bytes
    auto copy_chunks = [&](int it, int buf, int q0, int q1) {
        const int slot = box_slot(it);
        half* dst = ks + buf * STILE + lane * box_rows * 64;
        for (int q = q0; q < q1; q++) {
            uint64_t* bar = bars + buf * CHUNKS + q;
            if (slot < 0) {
                mbar_arrive_tx(bar, 0);
                continue;
            }
            mbar_arrive_tx(bar, box_rows * 128);
            if (q < C / 64) tma_2d(dst + q * CHUNK, &tm_ckv, 64 * q, slot, bar);
            else tma_2d(dst + q * CHUNK, &tm_kpe, 0, slot, bar);
        }
    };

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.f;
    float l0 = 0.f, l1 = 0.f;          // this thread's columns' share of rows r0 / r1's sums

    if (t1 > t0) {
        if (threadIdx.x == 0)
            for (int i = 0; i < 2 * CHUNKS; i++) mbar_init(bars + i, boxes);
        if (threadIdx.x < HB) sc[PP_M + threadIdx.x] = NEG_INF;
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        __syncthreads();
        if (copier) copy_chunks(t0 + wg, wg, 0, t0 + wg < t1 ? CHUNKS : 0);
        const int ra = warp * 8 + (lane >> 3);
        if constexpr (PAD) {          // a padded row reads the block's first (its copy zero-fills)
            const size_t q0 = (size_t)b * H + hc * HB, qa = q0 + (ra < nh ? ra : 0), qb = q0 + (ra + 4 < nh ? ra + 4 : 0);
            stage_rows_sw128(qs, {ql + qa * C, qp + qa * R}, {ql + qb * C, qp + qb * R}, ra < nh, ra + 4 < nh);
        } else {
            const size_t qa = (size_t)b * H + hc * HB + ra, qb = qa + 4;
            stage_rows_sw128(qs, {ql + qa * C, qp + qa * R}, {ql + qb * C, qp + qb * R});
        }
        cp_async_commit();
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();                                   // the queries, every thread's
        half* const ka = ks;
        half* const kb = ks + STILE;
        const uint64_t dq = sw128_desc(qs, 16, 1024);
        const uint64_t da = sw128_desc(ka, 16, 1024), db = sw128_desc(kb, 16, 1024);   // K-major: S, P
        const uint64_t va_desc = sw128_desc(ka, 2 * CHUNK, 1024) + wg * D_VHALF;      // N-major: this
        const uint64_t vb_desc = sw128_desc(kb, 2 * CHUNK, 1024) + wg * D_VHALF;      // warpgroup's V
        const uint64_t dpa = da + (CHUNKS - 1) * D_CHUNK, dpb = db + (CHUNKS - 1) * D_CHUNK;   // P_A, P_B
        for (int it = t0; it < t1; it += 2) {
            const int ph = ((it - t0) >> 1) & 1;
            const bool has_b = it + 1 < t1;
            const int va = L - it * TN, vb = va - TN;      // keys of A / B in range (>= TN: all)
            float s[32];
            uint32_t pa[4][4];
            float p0 = 0.f, p1 = 0.f;
            if (wg == 0) {
                scores(s, dq, da, bars, ph);
                float mx0, mx1;
                mask_rowmax(s, va, qk_scale, t4, mx0, mx1);
                const float mo0 = sc[PP_M + r0], mo1 = sc[PP_M + r1];
                const float m0 = fmaxf(mo0, mx0), m1 = fmaxf(mo1, mx1);
                const float f0 = rescale_from(mo0, m0), f1 = rescale_from(mo1, m1);
                exp_pack(s, m0, m1, pa, p0, p1);
                l0 = l0 * f0 + p0;
                l1 = l1 * f1 + p1;
                if constexpr (!PS) {                       // (PS: P_A once B's maxima are known)
                    store_p(ka + (CHUNKS - 1) * CHUNK, s, r0, t4);   // P_A over A's rope chunk (S read it)
                    fence_async_smem();
                }
                __syncwarp();                              // the quad read M before its lane 0 writes
                if (t4 == 0) {
                    sc[PP_M + r0] = m0;
                    sc[PP_M + r1] = m1;
                    sc[PP_SCALE0 + r0] = f0;
                    sc[PP_SCALE0 + r1] = f1;
                }
                named_arrive(BAR_SCALE0, 256);             // A's maxima, scale0 and (but for PS) P_A
                scale_o(o, f0, f1);
                if (va < TN) zero_rows(ka, va, 0, 4, wtid, 0);
                fence_regs(o);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < TN / 16; kk++) wgmma_m64n256k16<1>(o, pa[kk], va_desc + kk * D_V16);
                wgmma_commit();
                named_sync(BAR_SCALE1, 256);               // B's maxima (scale1 1 without B)
                const float g0 = sc[PP_SCALE1 + r0], g1 = sc[PP_SCALE1 + r1];
                if constexpr (PS) {                        // P_A at B's maxima, for WG1's P_A V_A,R
                    scale_p(s, g0, g1);
                    store_p(ka + (CHUNKS - 1) * CHUNK, s, r0, t4);   // over A's rope chunk (S read it)
                    fence_async_smem();
                    named_arrive(BAR_P0, 256);
                }
                wgmma_wait<0>();
                fence_regs(o);
                if (copier && it + 2 < t1) copy_chunks(it + 2, 0, 0, 4);   // A's V_L: read
                scale_o(o, g0, g1);
                l0 *= g0;
                l1 *= g1;
                if (has_b) {
                    named_sync(BAR_P1, 256);
                    for (int q = 0; q < 4; q++) mbar_wait(bars + CHUNKS + q, ph);   // WG1 saw them land; so do we
                    if (vb < TN) zero_rows(kb, vb, 0, 4, wtid, 0);
                    fence_regs(o);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < TN / 16; kk++) wgmma_ss_m64n256k16<1>(o, dpb + kk * D_K16, vb_desc + kk * D_V16);
                    wgmma_commit();
                    wgmma_wait<0>();
                    fence_regs(o);
                    if (copier && it + 3 < t1) {           // B's V_L and P_B: read
                        copy_chunks(it + 3, 1, 0, 4);
                        copy_chunks(it + 3, 1, CHUNKS - 1, CHUNKS);
                    }
                }
            } else if constexpr (PS) {
                float mx0 = NEG_INF, mx1 = NEG_INF;
                if (has_b) {
                    scores(s, dq, db, bars + CHUNKS, ph);
                    mask_rowmax(s, vb, qk_scale, t4, mx0, mx1);
                }
                named_sync(BAR_SCALE0, 256);           // A's maxima
                const float ma0 = sc[PP_M + r0], ma1 = sc[PP_M + r1];
                const float f0 = sc[PP_SCALE0 + r0], f1 = sc[PP_SCALE0 + r1];
                const float m0 = fmaxf(ma0, mx0), m1 = fmaxf(ma1, mx1);
                const float g0 = rescale_from(ma0, m0), g1 = rescale_from(ma1, m1);
                if (has_b) exp_pack(s, m0, m1, pa, p0, p1);
                __syncwarp();
                if (t4 == 0) {
                    sc[PP_M + r0] = m0;
                    sc[PP_M + r1] = m1;
                    sc[PP_SCALE1 + r0] = g0;
                    sc[PP_SCALE1 + r1] = g1;
                }
                named_arrive(BAR_SCALE1, 256);
                scale_o(o, f0 * g0, f1 * g1);          // O_R at B's maxima, once
                l0 = l0 * (f0 * g0) + p0;
                l1 = l1 * (f1 * g1) + p1;
                if (has_b) {
                    store_p(kb + (CHUNKS - 1) * CHUNK, s, r0, t4);   // over B's rope chunk
                    fence_async_smem();
                    named_arrive(BAR_P1, 256);
                    if (vb < TN) zero_rows(kb, vb, 4, 8, wtid, 1);
                    fence_regs(o);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < TN / 16; kk++) wgmma_m64n256k16<1>(o, pa[kk], vb_desc + kk * D_V16);
                    wgmma_commit();                    // P_B V_B,R, then at once P_A V_A,R
                }
                named_sync(BAR_P0, 256);               // P_A at B's maxima
                for (int q = 4; q < CHUNKS - 1; q++) mbar_wait(bars + q, ph);
                if (va < TN) zero_rows(ka, va, 4, 8, wtid, 1);
                fence_regs(o);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < TN / 16; kk++) wgmma_ss_m64n256k16<1>(o, dpa + kk * D_K16, va_desc + kk * D_V16);
                wgmma_commit();
                wgmma_wait<1>();                       // P_B V_B,R (without B: nothing to wait for)
                if (copier && it + 3 < t1) copy_chunks(it + 3, 1, 4, CHUNKS - 1);   // B's V_R: read
                wgmma_wait<0>();
                fence_regs(o);
                if (copier && it + 2 < t1) copy_chunks(it + 2, 0, 4, CHUNKS);   // A's V_R and P_A: read
            } else {
                float mx0 = NEG_INF, mx1 = NEG_INF;
                if (has_b) {
                    scores(s, dq, db, bars + CHUNKS, ph);
                    mask_rowmax(s, vb, qk_scale, t4, mx0, mx1);
                }
                named_sync(BAR_SCALE0, 256);               // A's maxima and P_A
                const float ma0 = sc[PP_M + r0], ma1 = sc[PP_M + r1];
                const float f0 = sc[PP_SCALE0 + r0], f1 = sc[PP_SCALE0 + r1];
                scale_o(o, f0, f1);                        // O_R at A's maxima
                for (int q = 4; q < CHUNKS - 1; q++) mbar_wait(bars + q, ph);
                if (va < TN) zero_rows(ka, va, 4, 8, wtid, 1);
                fence_regs(o);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < TN / 16; kk++) wgmma_ss_m64n256k16<1>(o, dpa + kk * D_K16, va_desc + kk * D_V16);
                wgmma_commit();                            // P_A V_A,R beside B's softmax
                const float m0 = fmaxf(ma0, mx0), m1 = fmaxf(ma1, mx1);
                const float g0 = rescale_from(ma0, m0), g1 = rescale_from(ma1, m1);
                if (has_b) exp_pack(s, m0, m1, pa, p0, p1);
                __syncwarp();
                if (t4 == 0) {
                    sc[PP_M + r0] = m0;
                    sc[PP_M + r1] = m1;
                    sc[PP_SCALE1 + r0] = g0;
                    sc[PP_SCALE1 + r1] = g1;
                }
                named_arrive(BAR_SCALE1, 256);
                if (has_b) {
                    store_p(kb + (CHUNKS - 1) * CHUNK, s, r0, t4);   // over B's rope chunk
                    fence_async_smem();
                    named_arrive(BAR_P1, 256);
                }
                wgmma_wait<0>();
                fence_regs(o);
                if (copier && it + 2 < t1) copy_chunks(it + 2, 0, 4, CHUNKS);   // A's V_R and P_A: read
                scale_o(o, g0, g1);
                l0 = l0 * (f0 * g0) + p0;
                l1 = l1 * (f1 * g1) + p1;
                if (has_b) {
                    if (vb < TN) zero_rows(kb, vb, 4, 8, wtid, 1);
                    fence_regs(o);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < TN / 16; kk++) wgmma_m64n256k16<1>(o, pa[kk], vb_desc + kk * D_V16);
                    wgmma_commit();
                    wgmma_wait<0>();
                    fence_regs(o);
                    if (copier && it + 3 < t1) copy_chunks(it + 3, 1, 4, CHUNKS - 1);   // B's V_R: read
                }
            }
        }
    }
    // the rows' sums: both warpgroups' shares (each at the final maxima) through shared memory
    SoftmaxState st{NEG_INF, NEG_INF, 0.f, 0.f};
    if (t1 > t0) {
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            l0 += __shfl_xor_sync(0xffffffffu, l0, x);
            l1 += __shfl_xor_sync(0xffffffffu, l1, x);
        }
        if (t4 == 0) {
            sc[PP_L + wg * HB + r0] = l0;
            sc[PP_L + wg * HB + r1] = l1;
        }
        __syncthreads();
        st.m0 = sc[PP_M + r0];
        st.m1 = sc[PP_M + r1];
        st.l0 = t4 == 0 ? sc[PP_L + r0] + sc[PP_L + HB + r0] : 0.f;     // the quad sums them again
        st.l1 = t4 == 0 ? sc[PP_L + r1] + sc[PP_L + HB + r1] : 0.f;
    }
    store_rows<PAD>(o, st, t1 > t0, out, po, plse, (size_t)b * H + hc * HB, sp, num_splits, direct, nh);
}

MLA_ENTRY_POINT(mla_decode_pp, pp_body<false>)
MLA_ENTRY_POINT(mla_decode_pp_pad, pp_body<true>)
MLA_ENTRY_POINT(mla_decode_pp_ps, pp_body<false, true>)
MLA_ENTRY_POINT(mla_decode_pp_ps_pad, pp_body<true, true>)
