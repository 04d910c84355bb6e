// Included by exl3_gemv.cu (inside its anonymous namespace, after the Hadamard helpers): the MoE
// prefill tile kernels' bodies. One translation unit per (K2, CB) still: the cubin is the same.
#pragma once

constexpr int YS = 132;   // floats per row of the epilogue's staged outputs (128 + 4: conflict-free writes)

// tiles_body's fused output pass, rows 32 at a time: each warp stages its two n-tiles' sums (D
// fragments) in ys, then each warp takes whole rows as had_out_body does (lane L: columns
// 4L..4L+3 of the block's 128, H128 across the warp, then 1/sqrt(128), svh and bias): the same
// operations in the same order on the same fp32 sums (one split: acc would have held exactly c).
template <int MB, typename TY>
__device__ __forceinline__ void tiles_epilogue(const float (&c)[MB][2][4], float (&ys)[32][YS], TY* __restrict__ y,
                                               const half* __restrict__ svh, const half* __restrict__ bias,
                                               int row0, int nr, int n, int col0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    float sv[4], bv[4] = {0.f, 0.f, 0.f, 0.f};
    load4(svh + col0 + 4 * lane, sv);
    if (bias) load4(bias + col0 + 4 * lane, bv);
#pragma unroll
    for (int h = 0; h < MB / 4; h++) {
        __syncthreads();                   // the previous pass's rows are read
#pragma unroll
        for (int mb = 0; mb < 4; mb++)
#pragma unroll
            for (int q = 0; q < 2; q++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    ys[8 * mb + 2 * t + q][32 * warp + 16 * j + g] = c[4 * h + mb][j][q];
                    ys[8 * mb + 2 * t + q][32 * warp + 16 * j + g + 8] = c[4 * h + mb][j][2 + q];
                }
        __syncthreads();
        for (int r = warp; r < 32 && 32 * h + r < nr; r += 4) {
            float v[4];
            load4(&ys[r][4 * lane], v);
            fwht128(v);
#pragma unroll
            for (int q = 0; q < 4; q++) v[q] = v[q] * 0.08838834764831845f * sv[q] + bv[q];
            store4(y + (size_t)(row0 + 32 * h + r) * n + col0 + 4 * lane, v);
        }
    }
}

// ------------------------------------------------------------------ prefill tiles (x staged in shared memory)
// The same contract, units and MMA as gemv_body, for tiles of 32-128 rows (MoE prefill): the four
// warps of a block are four adjacent n-groups of one slot and k-range, so they share the
// activations. Where gemv_body has every lane fetch its B fragments from global memory (2 loads
// per 8 rows and k-tile, and P stages of them in registers: 221 registers at 64 rows, 8 warps an
// SM), here the block copies P k-tiles x MROWS rows into shared memory with cp.async (double
// buffered) and each warp reads its fragments with ldmatrix.x4 (one per 16 rows and k-tile).
// Rows >= rows are zero-filled. A slot's tile decodes its expert's weights once for all MROWS
// rows; 128-row tiles would decode an expert with ~100 pairs once instead of twice, but at one
// n-tile a warp they read twice the shared memory per MMA and measured slower (H200: 5.31 vs 3.97
// ms at 64 rows for one GLM-5 projection at 2048 tokens), so the runtime takes 64. tile_n (or null):
// the valid rows of each slot; rows past it are zero-filled too and never added to acc, so the
// Hadamard passes may skip them (a MoE prefill's tiles are about half padding).
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* smem) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

// OUT 0: partial sums into acc (had_out follows); OUT 1 / 2: a whole k-range (one split) and NT 2,
// so the block holds 128 whole columns of its rows: the output Hadamard, svh and bias run here on
// the block's sums staged in shared memory and y (fp16 / fp32) is written directly; no workspace
// traffic, no had_out launch (tiles_epilogue).
// The slot-GEMM kernels' unit (tiles_body, wg_body): units are warps of NT n-tiles, WARPS a block;
// n_groups % WARPS == 0, so a block's warps share split and slot and every "nothing to do" (false)
// is the whole block's (no warp is left waiting at a barrier). Sets the split's k-tiles [i0, i1),
// the slot's expert e and valid rows nr, the warp's first n-tile j0, the lane's bit offset and
// weight pointers.
template <int NT, int WARPS>
__device__ __forceinline__ bool slot_unit(const uint64_t* __restrict__ trellis_ptrs, const int* __restrict__ slot_exp,
                                          const int* __restrict__ tile_n, int rows, int kt, int nt, int kps,
                                          int n_groups, int n_units, int lane, int& i0, int& i1, int& e,
                                          int& nr, int& j0, int& off, const uint32_t* (&wp)[NL]) {
    const int unit = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int grp = unit % n_groups, split = unit / n_groups;
    i0 = split * kps;
    i1 = min(kt, i0 + kps);
    if (unit >= n_units || i0 >= i1) return false;
    e = slot_exp ? slot_exp[blockIdx.y] : 0;
    nr = tile_n ? min(rows, tile_n[blockIdx.y]) : rows;
    if (e < 0 || nr <= 0) return false;
    int word;
    lane_origin(lane, word, off);
    j0 = grp * NT;
    weight_ptrs(reinterpret_cast<const uint32_t*>(trellis_ptrs[e]), i0, (size_t)nt * NW, j0, word, wp);
    return true;
}

template <int MROWS, int NT, int P, int OUT = 0>
__device__ __forceinline__ void tiles_body(const uint32_t* __restrict__ xrot, const uint64_t* __restrict__ trellis_ptrs,
                                           const int* __restrict__ slot_exp, float* __restrict__ acc,
                                           unsigned long long* __restrict__ acc64, int rows,
                                           int kt, int nt, int kps, int n_groups, int n_units,
                                           const int* __restrict__ tile_n, void* __restrict__ y = nullptr,
                                           const uint64_t* __restrict__ svh_ptrs = nullptr,
                                           const uint64_t* __restrict__ bias_ptrs = nullptr) {
    constexpr int MB = MROWS / 8;          // 8-row blocks (even: one ldmatrix.x4 feeds two)
    constexpr int XS = P * 16 + 8;         // halves per staged row: P k-tiles + 16 B (ldmatrix rows hit distinct banks)
    static_assert(MB % 2 == 0 && (MROWS * 2 * P) % 128 == 0, "tile shape");
    static_assert(OUT == 0 || (NT == 2 && MROWS % 32 == 0), "the epilogue needs 128 columns a block");
    __shared__ __align__(16) half xs[2][MROWS][XS];
    __shared__ __align__(16) float ys[OUT ? 32 : 1][OUT ? YS : 4];
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31;
    const int z = blockIdx.y;
    int i0, i1, e, nr, j0, off;            // (n_groups % 4 == 0: n % 128 == 0)
    const uint32_t* wp[NL];
    if (!slot_unit<NT, 4>(trellis_ptrs, slot_exp, tile_n, rows, kt, nt, kps, n_groups, n_units, lane, i0, i1, e, nr,
                          j0, off, wp))
        return;
    const int g = lane >> 2, t = lane & 3;
    const int n = nt * 16;
    const size_t row_stride = (size_t)nt * NW;

    float c[MB][NT][4];
    zero_fragments<MB, NT>(c);

    const Consts kc;
    uint32_t wb[P][NT][NL];
    auto load_w = [&](int p, bool pred) { load_tiles<NT>(wb[p], wp, row_stride, pred); };
    // chunk ch = k-tiles i0 + P ch .. + P - 1 of the slot's MROWS rows: 16-byte copies, P * 2 a row
    const half* xh = reinterpret_cast<const half*>(xrot);
    const size_t krow = (size_t)kt * 16;
    auto load_x = [&](int ch, int buf) {
        const int kcol = (i0 + P * ch) * 16;
#pragma unroll
        for (int q = 0; q < MROWS * 2 * P / 128; q++) {
            const int s = q * 128 + threadIdx.x;
            const int m = s / (2 * P), seg = s % (2 * P);
            const bool ok = m < nr;
            cp_async16(&xs[buf][m][seg * 8], xh + (size_t)(z * rows + (ok ? m : 0)) * krow + kcol + seg * 8, ok);
        }
        cp_async_commit();
    };
    // ldmatrix.x4 of rows 16q.. : lanes 0-7 rows 0-7 k 0-7, 8-15 rows 0-7 k 8-15, 16-31 rows 8-15:
    // r[0], r[1] = the B fragment (b0, b1) of 8-row block 2q, r[2], r[3] of block 2q + 1
    const int lrow = (lane & 7) + ((lane >> 4) << 3), lcol = ((lane >> 3) & 1) * 8;
    auto step = [&](int p, int buf) {
        uint32_t a[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            uint32_t b[4];
            decode_tile(kc, wb[p][j], off, b);
            a[j][0] = b[0]; a[j][1] = b[2]; a[j][2] = b[1]; a[j][3] = b[3];
        }
#pragma unroll
        for (int q = 0; q < MB / 2; q++) {
            uint32_t x[4];
            ldsm4(x, &xs[buf][16 * q + lrow][16 * p + lcol]);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                mma(c[2 * q][j], a[j], x[0], x[1]);
                mma(c[2 * q + 1][j], a[j], x[2], x[3]);
            }
        }
    };
    const int count = i1 - i0;             // a multiple of P: kt % 8 == 0 and kps % P == 0
    const int chunks = count / P;
#pragma unroll
    for (int p = 0; p < P; p++) load_w(p, p < count);
    pdl_wait();
    load_x(0, 0);
    for (int ch = 0; ch < chunks; ch++) {
        const int buf = ch & 1;
        if (ch + 1 < chunks) {
            load_x(ch + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
#pragma unroll
        for (int p = 0; p < P; p++) {
            step(p, buf);
            load_w(p, ch * P + p + P < count);
        }
        __syncthreads();                   // every warp is done with buf before chunk ch + 2 refills it
    }

    if constexpr (OUT == 0) {
        add_fragments<MB, NT>(acc, acc64, c, z * rows, nr, n, j0, g, t);
    } else {
        const half* bias = bias_ptrs ? reinterpret_cast<const half*>(bias_ptrs[e]) : nullptr;
        using TY = typename std::conditional<OUT == 1, half, float>::type;
        tiles_epilogue<MB, TY>(c, ys, reinterpret_cast<TY*>(y), reinterpret_cast<const half*>(svh_ptrs[e]), bias,
                               z * rows, nr, n, j0 * 16 - (threadIdx.x >> 5) * 32);
    }
}
