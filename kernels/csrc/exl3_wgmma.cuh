// Included by exl3_gemv.cu (inside its anonymous namespace, after exl3_tiles.cuh): dense linears of
// 65-256 rows a slot on Hopper's warpgroup MMA (wgmma), the weight decoded once for all the rows.
#pragma once

// A warpgroup (4 warps) holds four adjacent n-tile groups (NT n-tiles a warp) x one k-range, every
// row of its slot; WGS warpgroups a block share the staged activations. Each k-tile a warp decodes
// its 16 x 16 tiles of Ŵᵀ into registers, which is exactly its share of wgmma's register A operand
// (m64nNk16: warp w holds rows 16w..16w+15, in mma.m16n8k16's A fragment layout, the same a[]
// tiles_body feeds its mma.sync), and one wgmma a tile multiplies those 64 columns by all MROWS
// rows of the k-tile's activations, which the block stages in shared memory in wgmma's K-major
// no-swizzle layout: for each 8-row group two 8 x 16-byte core matrices (k 0-7, k 8-15), rows 16
// bytes apart (LBO 128 B between the two halves, SBO 256 B between row groups). The MMA is
// asynchronous: the warps decode the next k-tiles while it runs (P - 1 more in flight; one A
// operand a k-tile of a chunk of P; the activations in a ring of three chunks). Accumulators D
// (64 x MROWS fp32 a tile): d[jt][4i + q] is mma.m16n8's c[q] of the 8-row block i, so
// add_fragments writes them as tiles_body's c[i][jt][q]. The wrappers' operand lists were written
// out by a script (128 / 64 accumulators).

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
                 "{%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// both operands from shared memory, 64 x 128 (exl3_wga_*: Ŵᵀ's 64 columns x a warpgroup's 128 rows)
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "%64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b));
}

template <int MROWS>
__device__ __forceinline__ void wgmma_k16(float (&d)[MROWS / 2], const uint32_t (&a)[4], uint64_t desc) {
    if constexpr (MROWS == 128) wgmma_m64n128k16(d, a, desc);
    else wgmma_m64n256k16<0>(d, a, desc);
}
// descriptor of one k-tile's staged operand (K-major, no swizzle): start address, LBO 128 B, SBO 256 B
__device__ __forceinline__ uint64_t wg_desc(const void* smem) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return (uint64_t)((s & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
}
// where (halves) element (row m, k) of a k-tile lies in that layout: 8 x 8 core matrices of 16-byte
// rows, the two k halves LBO (64 halves) apart, the 8-row groups SBO (128 halves) apart
__device__ __forceinline__ int kmajor_at(int m, int k) { return (m >> 3) * 128 + (k >> 3) * 64 + (m & 7) * 8 + (k & 7); }

// tiles_body's contract (acc += xrot @ Ŵ per slot z, rows z*rows.., tile_n, the fp32 or fixed-point
// workspace): units are warps of NT adjacent n-tiles, four of one split a block (n_groups % 4 == 0);
// NT 2 (128 rows only: 2 x 64 accumulators) is a block of 128 columns, two MMAs a k-tile over the
// same staged activations (half the activation reads a column of NT 1). WGS warpgroups a block
// share the staged activations: 4 WGS warps of adjacent n-tiles (WGS 2: a quarter of NT 1's reads).
template <int MROWS, int NT, int P, int WGS>
__device__ __forceinline__ void wg_body(const uint32_t* __restrict__ xrot, const uint64_t* __restrict__ trellis_ptrs,
                                        const int* __restrict__ slot_exp, float* __restrict__ acc,
                                        unsigned long long* __restrict__ acc64, int rows,
                                        int kt, int nt, int kps, int n_groups, int n_units,
                                        const int* __restrict__ tile_n) {
    constexpr int MB = MROWS / 8;
    constexpr int KTILE = MROWS * 16;      // halves of one staged k-tile
    static_assert((MROWS == 128 || MROWS == 256) && (NT == 1 || MROWS == 128), "wgmma N; accumulators");
    static_assert((P == 2 || P == 4) && (MROWS * 2 * P) % (128 * WGS) == 0, "stages");
    __shared__ __align__(128) half xs[3][P][KTILE];   // 48 KiB at 256 rows (the static limit)
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31;
    const int z = blockIdx.y;
    // the whole block returns together (n_groups % (4 WGS) == 0): wgmma and the barriers are block-wide
    int i0, i1, e, nr, j0, off;            // NT adjacent n-tiles a warp from j0: MMA jt takes each warp's jt-th
    const uint32_t* wp[NL];
    if (!slot_unit<NT, 4 * WGS>(trellis_ptrs, slot_exp, tile_n, rows, kt, nt, kps, n_groups, n_units, lane, i0, i1, e,
                                nr, j0, off, wp))
        return;
    const int g = lane >> 2, t = lane & 3;
    const int n = nt * 16;
    const size_t row_stride = (size_t)nt * NW;

    float d[NT][MROWS / 2];
#pragma unroll
    for (int jt = 0; jt < NT; jt++)
#pragma unroll
        for (int i = 0; i < MROWS / 2; i++) d[jt][i] = 0.f;

    const Consts kc;
    uint32_t wb[P][NT][NL];
    auto load_w = [&](int p, bool pred) { load_tiles<NT>(wb[p], wp, row_stride, pred); };
    const half* xh = reinterpret_cast<const half*>(xrot);
    const size_t krow = (size_t)kt * 16;
    // chunk ch = k-tiles i0 + P ch .. + P - 1: 16-byte pieces (row m, k half h) to row group m / 8,
    // half h, row m % 8 of the k-tile's core matrices
    auto load_x = [&](int ch, int buf) {
        const int kcol = (i0 + P * ch) * 16;
#pragma unroll
        for (int q = 0; q < MROWS * 2 * P / (128 * WGS); q++) {
            const int s = q * 128 * WGS + threadIdx.x;
            const int p = s / (MROWS * 2), rem = s % (MROWS * 2);
            const int m = rem >> 1, h = rem & 1;
            const bool ok = m < nr;
            cp_async16(&xs[buf][p][kmajor_at(m, 8 * h)],
                       xh + (size_t)(z * rows + (ok ? m : 0)) * krow + kcol + 16 * p + 8 * h, ok);
        }
        cp_async_commit();
    };
    // three buffers of P k-tiles: chunk ch + 2 is copied into the one chunk ch - 1 used once this
    // block's MMAs of chunk ch - 1 are done, which the last MMA of chunk ch waits for (P - 1 in
    // flight behind it), so the MMAs never drain between chunks. A register operand a[p] per k-tile
    // of a chunk: the MMA that last read a[p] was issued P MMAs earlier, so it is done.
    uint32_t a[P][NT][4];
    const int count = i1 - i0;             // a multiple of P (kt % 8 == 0, kps % 4 == 0, P | 4)
    const int chunks = count / P;
#pragma unroll
    for (int p = 0; p < P; p++) load_w(p, p < count);
    pdl_wait();
    load_x(0, 0);
    if (chunks > 1) load_x(1, 1); else cp_async_commit();
    int buf = 0;
    for (int ch = 0; ch < chunks; ch++) {
        cp_async_wait<1>();                // chunk ch is here (ch + 1 may still be on its way)
        fence_async_smem();
        __syncthreads();
#pragma unroll
        for (int p = 0; p < P; p++) {
#pragma unroll
            for (int jt = 0; jt < NT; jt++) {
                uint32_t b[4];
                decode_tile(kc, wb[p][jt], off, b);
                a[p][jt][0] = b[0]; a[p][jt][1] = b[2]; a[p][jt][2] = b[1]; a[p][jt][3] = b[3];
            }
            load_w(p, ch * P + p + P < count);
#pragma unroll
            for (int jt = 0; jt < NT; jt++) fence_regs(d[jt]);
            wgmma_fence();
            const uint64_t desc = wg_desc(&xs[buf][p][0]);
#pragma unroll
            for (int jt = 0; jt < NT; jt++) wgmma_k16<MROWS>(d[jt], a[p][jt], desc);
            wgmma_commit();
            wgmma_wait<P - 1>();           // the group P before this one is done: its a[] are free
#pragma unroll
            for (int jt = 0; jt < NT; jt++) fence_regs(d[jt]);
            if (p == P - 1) {
                __syncthreads();           // ... in every warp: chunk ch - 1's buffer is free
                const int nb = buf == 0 ? 2 : buf - 1;
                if (ch + 2 < chunks) load_x(ch + 2, nb); else cp_async_commit();
            }
        }
        buf = buf == 2 ? 0 : buf + 1;
    }
    wgmma_wait<0>();
    float c[MB][NT][4];
#pragma unroll
    for (int jt = 0; jt < NT; jt++) {
        fence_regs(d[jt]);
#pragma unroll
        for (int i = 0; i < MB; i++)
#pragma unroll
            for (int q = 0; q < 4; q++) c[i][jt][q] = d[jt][4 * i + q];
    }
    add_fragments<MB, NT>(acc, acc64, c, z * rows, nr, n, j0, g, t);
}


// A warpgroup's accumulators of Ŵᵀ's 64 columns x CROWS rows (wgmma m64nCROWS: d[4 i + q] is
// mma.m16n8's c[q] of the 8-row block i) added into rows row0.. of acc (ws3_body, wga_body)
template <int CROWS>
__device__ __forceinline__ void add_wgmma_d(float* __restrict__ acc, unsigned long long* __restrict__ acc64,
                                            const float (&d)[CROWS / 2], int row0, int valid, int n, int j0, int g,
                                            int t) {
    float cf[CROWS / 8][1][4];
#pragma unroll
    for (int i = 0; i < CROWS / 8; i++)
#pragma unroll
        for (int q = 0; q < 4; q++) cf[i][0][q] = d[4 * i + q];
    add_fragments<CROWS / 8, 1>(acc, acc64, cf, row0, valid, n, j0, g, t);
}
// A block of four units of two n-tiles (ws3_body, wga_body; tiles_body's contract, n_groups % 4 ==
// 0): the split's k-tiles [i0, i1), the slot's expert e and valid rows nr, the block's first n-tile
// jb; false: nothing to do, for the whole block
__device__ __forceinline__ bool block_units(const int* __restrict__ slot_exp, const int* __restrict__ tile_n, int rows,
                                            int kt, int kps, int n_groups, int n_units, int& i0, int& i1, int& e,
                                            int& nr, int& jb) {
    const int unit0 = blockIdx.x * 4;
    const int grp = unit0 % n_groups, split = unit0 / n_groups;
    i0 = split * kps;
    i1 = min(kt, i0 + kps);
    if (unit0 >= n_units || i0 >= i1) return false;
    e = slot_exp ? slot_exp[blockIdx.y] : 0;
    nr = tile_n ? min(rows, tile_n[blockIdx.y]) : rows;
    if (e < 0 || nr <= 0) return false;
    jb = grp * 2;
    return true;
}
// a chunk's trellis words for a staged decode (wga_body, wgr_body): its KS k-tile rows of the
// block's 8 tiles (32 NW contiguous bytes each, from trb: n-tile jb of the split's first k-tile)
// into dst through the TMA unit, completing on bar
template <int KS>
__device__ __forceinline__ void chunk_words(uint32_t* dst, const uint32_t* trb, size_t row_stride, int c,
                                            uint64_t* bar) {
#pragma unroll
    for (int kk = 0; kk < KS; kk++)
        bulk_copy(dst + kk * 8 * NW, trb + (size_t)(KS * c + kk) * row_stride, 8 * NW * 4, bar);
}
// where a lane reads its NL words of a staged tile: words wi[m] (its window's, wrapping) and the
// first one's bit offset
__device__ __forceinline__ void staged_lane_words(int lane, int (&wi)[NL], int& off) {
    int word;
    lane_origin(lane, word, off);
#pragma unroll
    for (int m = 0; m < NL; m++) wi[m] = (word + m) % NW;
}

// Warp-specialized (the decode apart from the MMAs), the 2026-12-03 16:47 session: a block holds
// 128 columns (8 n-tiles) x one k-range x the slot's 128 rows, under tiles_body's contract (units of
// 2 n-tiles, four a block: n_groups % 4 == 0), in 1024 threads (64 registers). Four consumer
// warpgroups each multiply 64 columns by 64 rows (m64n64k16, both operands from shared memory,
// 32 accumulators); two producer groups of 8 warps decode. Group q fills the chunks (WS3_KS
// k-tiles) c with c % 2 == q into stage c % WS3_S of dynamic shared memory (cuda_launch.WS3_SMEM):
// it copies the chunk's activations (cp.async; the decode hides the copy), then warp pw decodes
// n-tile pw of each k-tile straight from the trellis into wgmma's K-major no-swizzle layout (the
// activations' core matrices: LBO 128 B, SBO 256 B) while loading its next chunk's weights into
// registers. FULL + u / EMPTY + u: stage u's handshakes, named barriers between the consumers and
// the group that fills u. On the H200 it is exact and slower than exl3_tiles_m128_t2 (docs/gpu-sessions.md,
// the 16:47 session): earlier versions, one k-tile a stage with 8 or 16 decoding warps (512 /
// 1024 threads; a 768-thread one with setmaxnreg failed in ptxas, which kept the m64n128 MMA at the
// launch's 80 registers), ran 2.0-2.8x cuBLAS at 128 rows; stages of 4 k-tiles halved the
// producers' instructions a tile (145 -> 72, the gemv 52) and gained 3-25 %.
// WD > 0 (exl3_ws4_*, the 16:47 session's ncu finding: the producers waited on their weight loads,
// prefetched one chunk ahead in registers): each producer warp copies its n-tile's raw trellis words
// of the group's chunk WD chunks ahead into a ring of WD slots in shared memory (cp.async, 16-byte
// pieces: a tile is K2 of them), and its lanes read their NL words of a tile from there.
constexpr int WS3_KS = 4, WS3_S = 4, WS4_WD = 3;
template <int PG, int CW, int WD>
__device__ __forceinline__ void ws3_body(const uint32_t* __restrict__ xrot, const uint64_t* __restrict__ trellis_ptrs,
                                         const int* __restrict__ slot_exp, float* __restrict__ acc,
                                         unsigned long long* __restrict__ acc64, int rows, int kt, int nt, int kps,
                                         int n_groups, int n_units, const int* __restrict__ tile_n) {
    constexpr int KS = WS3_KS, S = WS3_S, MROWS = 128;
    static_assert(PG == 2 && CW == 4 && S % PG == 0, "one producer group a stage's barriers; m64n64 consumers");
    static_assert(WD == 0 || WD >= 2, "a ring of WD chunks a warp");
    constexpr int WDS = WD > 0 ? WD : 1;
    constexpr int CT = 128 * CW;
    constexpr int A_TILE = 2 * 64 * 16, X_TILE = MROWS * 16;   // halves a k-tile: A [consumer half][64 x 16], x
    constexpr int A_STAGE = KS * A_TILE, X_STAGE = KS * X_TILE;
    // [S][A_STAGE] then [S][X_STAGE] halves, then (WD) [producer warp][WD][KS][NW] uint32
    extern __shared__ __align__(128) unsigned char ws3_smem[];
    half* const as = reinterpret_cast<half*>(ws3_smem);
    half* const xs = as + S * A_STAGE;
    pdl_launch_dependents();
    const int z = blockIdx.y;
    int i0, i1, e, nr, jb;
    if (!block_units(slot_exp, tile_n, rows, kt, kps, n_groups, n_units, i0, i1, e, nr, jb)) return;
    const int chunks = (i1 - i0) / KS;     // (i1 - i0) % 4 == 0
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    constexpr int FULL = 1, EMPTY = 1 + S, BAR = CT + 256;

    if (warp >= CT / 32) {                 // ---- producers
        const int pw = (warp - CT / 32) & 7, q = (warp - CT / 32) >> 3, pt = (threadIdx.x - CT) & 255;
        int word, off;
        lane_origin(lane, word, off);
        const size_t row_stride = (size_t)nt * NW;
        const size_t skip = (size_t)(PG - 1) * KS * row_stride;   // past the other groups' chunks
        const uint32_t* wp[NL];
        weight_ptrs(reinterpret_cast<const uint32_t*>(trellis_ptrs[e]), i0 + q * KS, row_stride, jb + pw, word, wp);
        const Consts kc;
        uint32_t wb[KS][1][NL];
        // (WD) the warp's ring, its n-tile's words from k-tile i0, this lane's words of a tile
        uint32_t* const wring = reinterpret_cast<uint32_t*>(xs + S * X_STAGE) + (warp - CT / 32) * WD * KS * NW;
        const uint32_t* const trw = reinterpret_cast<const uint32_t*>(trellis_ptrs[e]) + (size_t)i0 * row_stride +
                                    (size_t)(jb + pw) * NW;
        int wi[NL];
#pragma unroll
        for (int mm = 0; mm < NL; mm++) wi[mm] = (word + mm) % NW;
        auto load_w = [&](int c, int slot) {   // chunk c's KS tiles into ring slot `slot`, then commit
#pragma unroll
            for (int p0 = 0; p0 < KS * K2; p0 += 32) {
                const int p = p0 + lane, kk = p / K2, r = p % K2;
                if (p < KS * K2)
                    cp_async16(wring + (slot * KS + kk) * NW + 4 * r, trw + (size_t)(c * KS + kk) * row_stride + 4 * r,
                               c < chunks);
            }
            cp_async_commit();
        };
        if constexpr (WD == 0) {
#pragma unroll
            for (int kk = 0; kk < KS; kk++) load_tiles<1>(wb[kk], wp, row_stride, q < chunks);
#pragma unroll
            for (int mm = 0; mm < NL; mm++) wp[mm] += skip;
        }
        const half* xh = reinterpret_cast<const half*>(xrot);
        const size_t krow = (size_t)kt * 16;
        const int m = pt >> 1, h = pt & 1;                   // this thread's 16-byte piece of a k-tile
        const bool ok = m < nr;
        const half* xsrc = xh + (size_t)(z * rows + (ok ? m : 0)) * krow + (size_t)i0 * 16 + 8 * h;
        const int xoff = kmajor_at(m, 8 * h);
        // this lane's four A registers' places (halves) in its consumer's 64 x 16 tile: rows 16 (pw % 4)
        // + g (+ 8), k 2t (+ 8) of the core-matrix layout
        const int r0 = 16 * (pw & 3) + g, r1 = r0 + 8;
        const int o0 = kmajor_at(r0, 2 * t), o1 = kmajor_at(r1, 2 * t), o8 = kmajor_at(0, 8);
        pdl_wait();
        if constexpr (WD > 0) {
            // the group's first WD chunks; each after an empty group, so that the commits keep
            // one pattern (an activations' group, a weights' group) from the start
#pragma unroll
            for (int d = 0; d < WD; d++) {
                cp_async_commit();
                load_w(q + PG * d, d);
            }
        }
        for (int c = q, it = 0; c < chunks; c += PG, it++) {
            const int u = c % S;
            if (c >= S) named_sync(EMPTY + u, BAR);          // chunk c - S's MMAs are done
            half* const xst = xs + u * X_STAGE + xoff;
#pragma unroll
            for (int kk = 0; kk < KS; kk++) cp_async16(xst + kk * X_TILE, xsrc + (size_t)(c * KS + kk) * 16, ok);
            cp_async_commit();
            const uint32_t* const wslot = wring + (it % WDS) * KS * NW;
            if constexpr (WD > 0) {
                cp_async_wait<2 * WD - 1>();   // this chunk's weights (2 WD - 1 groups were committed since)
                __syncwarp();                  // ... every lane's pieces of them
            }
            uint32_t* const a32 = reinterpret_cast<uint32_t*>(as + u * A_STAGE + (pw >> 2) * (A_TILE / 2));
            const bool more = c + PG < chunks;
#pragma unroll
            for (int kk = 0; kk < KS; kk++) {
                uint32_t b[4];
                if constexpr (WD > 0) {
#pragma unroll
                    for (int mm = 0; mm < NL; mm++) wb[kk][0][mm] = wslot[kk * NW + wi[mm]];
                }
                decode_tile(kc, wb[kk][0], off, b);
                if constexpr (WD == 0) load_tiles<1>(wb[kk], wp, row_stride, more);  // the group's next chunk
                uint32_t* const ak = a32 + kk * (A_TILE / 2);
                ak[o0 >> 1] = b[0];
                ak[o1 >> 1] = b[2];
                ak[(o0 + o8) >> 1] = b[1];                    // k + 8: the other core matrix
                ak[(o1 + o8) >> 1] = b[3];
            }
            if constexpr (WD == 0) {
#pragma unroll
                for (int mm = 0; mm < NL; mm++) wp[mm] += skip;
            }
            cp_async_wait<0>();            // this thread's activations of the chunk have landed
            fence_async_smem();            // the stage's generic-proxy writes, visible to wgmma
            named_arrive(FULL + u, BAR);
            if constexpr (WD > 0) {
                __syncwarp();              // every lane has read the slot: refill it, WD chunks on
                load_w(c + WD * PG, it % WDS);
            }
        }
        if constexpr (WD > 0) cp_async_wait<0>();   // (the ring's last, empty refills: none left in flight)
        return;
    }
    // ---- consumers: warpgroup c takes columns 64 (c % 2).. of the block and rows 64 (c / 2)..
    constexpr int CROWS = 64, CA = CROWS / 2;
    const int c = warp >> 2, ch = c & 1, r0 = (c >> 1) * CROWS;
    float d[CA];
#pragma unroll
    for (int i = 0; i < CA; i++) d[i] = 0.f;
    pdl_wait();                            // (the workspace below is the previous kernels')
    for (int cc = 0; cc < chunks; cc++) {
        const int u = cc % S;
        named_sync(FULL + u, BAR);
        fence_regs(d);
        wgmma_fence();
        const half* const ast = as + u * A_STAGE + ch * (A_TILE / 2);
        const half* const xst = xs + u * X_STAGE + kmajor_at(r0, 0);
#pragma unroll
        for (int kk = 0; kk < KS; kk++) wgmma_ss_m64n64k16(d, wg_desc(ast + kk * A_TILE), wg_desc(xst + kk * X_TILE));
        wgmma_commit();
        wgmma_wait<1>();                   // chunk cc - 1's MMAs are done: its stage may be refilled
        fence_regs(d);
        if (cc >= 1 && cc - 1 + S < chunks) named_arrive(EMPTY + (cc - 1) % S, BAR);
    }
    wgmma_wait<0>();
    fence_regs(d);
    if (r0 >= nr) return;
    add_wgmma_d<CROWS>(acc, acc64, d, z * rows + r0, nr - r0, nt * 16, jb + 4 * ch + (warp & 3), g, t);
}


// Every warp decodes, every warpgroup multiplies (the 2026-12-06 session; docs/gpu.md "What is left"
// 2): a block holds 128 columns (8 n-tiles) x one k-range x a slot of 256 rows, under tiles_body's
// contract (units of 2 n-tiles, four a block), in 512 threads (128 registers). Chunks of WGA_KS
// k-tiles run through WGA_S stages of dynamic shared memory (cuda_launch.WGA_SMEM): each warp decodes
// two tiles of the next chunk (n-tile w % 8, k-tiles 2 (w / 8) and the one after) straight into
// shared memory while this chunk's asynchronous MMAs run; then one barrier, and each warpgroup
// issues its m64n128k16 MMAs (64 columns x 128 rows, both operands from shared memory, 64
// accumulators). A stage holds Ŵᵀ (128 columns) and x (256 rows) as rows of a chunk's 64 k (128
// bytes) in the 128-byte swizzle, K-major (SBO 1024 B; a k16 step 32 bytes on); without the swizzle
// (ws3's core-matrix layout, LBO 128 B, SBO 256 B) the first version ran 5-6x slower than its MMAs
// (H100). Three stages: a stage is rewritten two chunks after its MMAs were issued, and every
// warpgroup waits for those (wgmma.wait_group 1 behind the newest) before the barrier that
// precedes the rewrite. The trellis words come WGA_TS chunks ahead through the TMA unit (bulk copies
// of each k-tile's 8 tiles into a ring, an mbarrier a slot): the proxy fence that makes the decoded
// stores visible to wgmma waits for every load of the thread still in flight, so words loaded into
// registers a chunk ahead (the version before) put a whole load latency into every chunk. The
// activations come as one TMA box a stage (the slot's 256 rows x 64 k, its own mbarrier; rows past
// the tensor are zeros). The EXL3TOOLS_DENSE_WGA preview (cuda_exl3.WGA_KERNEL): at 256 rows, K 3,
// 1.28-1.87x fp16 cuBLAS against decode + cuBLAS's 2.08-2.36x (H100, docs/gpu.md).
#ifndef WGA_S
#define WGA_S 3   // stages (a tuning define; cuda_launch.WGA_SMEM holds 4)
#endif
constexpr int WGA_KS = 4, WGA_TS = 4;
#ifndef WGA_PROBE
// a bench-only build define that times one side of the loop alone (wrong results): 1 no MMAs, 2 no
// decode (the ring's waits and the barriers stay)
#define WGA_PROBE 0
#endif
template <int MROWS>
__device__ __forceinline__ void wga_body(const uint32_t* __restrict__ xrot, const uint64_t* __restrict__ trellis_ptrs,
                                         const int* __restrict__ slot_exp, float* __restrict__ acc,
                                         unsigned long long* __restrict__ acc64, int rows, int kt, int nt, int kps,
                                         int n_groups, int n_units, const int* __restrict__ tile_n,
                                         const CUtensorMap& xmap) {
    constexpr int KS = WGA_KS, S = WGA_S, CROWS = MROWS / 2;
    static_assert(S == 3 || S == 4, "stages");
    static_assert(MROWS == 256 && KS == 4, "four warpgroups: two column halves x two row halves; 128-byte rows");
    constexpr int A_STAGE = 128 * 64, X_STAGE = MROWS * 64;    // halves: 128 columns, MROWS rows x 64 k
    constexpr int TS = WGA_TS, W_SLOT = KS * 8 * NW;           // uint32 of a chunk's trellis words
    // [S][A_STAGE], [S][X_STAGE] halves, [TS][W_SLOT] uint32, TS + S mbarriers (the words', x's)
    extern __shared__ __align__(1024) unsigned char wga_smem[];
    half* const as = reinterpret_cast<half*>(wga_smem);
    half* const xs = as + S * A_STAGE;
    uint32_t* const ws = reinterpret_cast<uint32_t*>(xs + S * X_STAGE);
    uint64_t* const bars = reinterpret_cast<uint64_t*>(ws + TS * W_SLOT);
    uint64_t* const xbars = bars + TS;
    pdl_launch_dependents();
    const int z = blockIdx.y;
    int i0, i1, e, nr, jb;
    if (!block_units(slot_exp, tile_n, rows, kt, kps, n_groups, n_units, i0, i1, e, nr, jb)) return;
    const int chunks = (i1 - i0) / KS;     // (i1 - i0) % 4 == 0
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;

    // ---- the trellis words: thread 0 copies chunk c's (k-tile rows of the block's 8 tiles, 32 NW
    // contiguous bytes each) into ring slot c % TS
    const size_t row_stride = (size_t)nt * NW;
    const uint32_t* const trb = reinterpret_cast<const uint32_t*>(trellis_ptrs[e]) + (size_t)i0 * row_stride +
                                (size_t)jb * NW;
    auto fetch_w = [&](int c) {
        uint64_t* const bar = bars + c % TS;
        mbar_arrive_tx(bar, W_SLOT * 4);
        chunk_words<KS>(ws + (c % TS) * W_SLOT, trb, row_stride, c, bar);
    };
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < TS + S; i++) mbar_init(bars + i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0)                  // (the weights are the launch's constants: before pdl_wait)
        for (int c = 0; c < TS && c < chunks; c++) fetch_w(c);
    // ---- the decode: n-tile pw, k-tiles 2 kh and 2 kh + 1 of every chunk, lane words (word + m) % NW
    const int pw = warp & 7, kh = warp >> 3;
    int wi[NL], off;
    staged_lane_words(lane, wi, off);
    const Consts kc;
    // this lane's registers of a tile: b[0] / b[2] columns 16 pw + g / + 8 at k 2t, b[1] / b[3] at
    // k 2t + 8: uint32 places in the stage's rows (k-tile kk: pieces 2 kk, 2 kk + 1); the lanes of
    // one store hit 32 distinct banks (the swizzle spreads the 8 columns over the 8 pieces)
    const int ca = 16 * pw + g, cb = ca + 8;
    auto decode = [&](int c) {
        uint32_t* const a32 = reinterpret_cast<uint32_t*>(as + (c % S) * A_STAGE);
        mbar_wait(bars + c % TS, (c / TS) & 1);
        const uint32_t* const wsl = ws + (c % TS) * W_SLOT + pw * NW;
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int kk = 2 * kh + q;
            uint32_t w[NL], b[4];
            if constexpr (WGA_PROBE == 2) continue;
#pragma unroll
            for (int m = 0; m < NL; m++) w[m] = wsl[kk * 8 * NW + wi[m]];
            decode_tile(kc, w, off, b);
            a32[(sw128_at(ca, 2 * kk) >> 1) + t] = b[0];
            a32[(sw128_at(cb, 2 * kk) >> 1) + t] = b[2];
            a32[(sw128_at(ca, 2 * kk + 1) >> 1) + t] = b[1];
            a32[(sw128_at(cb, 2 * kk + 1) >> 1) + t] = b[3];
        }
    };
    // ---- the activations: thread 0 copies chunk c's (the slot's MROWS rows x 64 k, one TMA box in
    // the 128-byte swizzle; rows past the tensor come as zeros) into stage c % S
    auto load_x = [&](int c) {
        uint64_t* const bar = xbars + c % S;
        mbar_arrive_tx(bar, X_STAGE * 2);
        tma_2d(xs + (c % S) * X_STAGE, &xmap, (i0 + KS * c) * 16, z * rows, bar);
    };
    // ---- the MMAs: warpgroup wg, columns 64 ch.. of the block x rows rw0..
    const int wg = warp >> 2, ch = wg & 1, rw0 = (wg >> 1) * CROWS;
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; i++) d[i] = 0.f;
    // stage 0's descriptors of this warpgroup's operands; a descriptor's address field is the byte
    // address / 16 (14 bits: all of shared memory), so another stage or k16 step is an addition
    const uint64_t da0 = sw128_desc(as + ch * 64 * 64, 16, 1024), db0 = sw128_desc(xs + rw0 * 64, 16, 1024);
    auto issue = [&](int c) {
        const uint64_t da = da0 + (c % S) * (A_STAGE * 2 / 16), db = db0 + (c % S) * (X_STAGE * 2 / 16);
        if constexpr (WGA_PROBE == 1) return;
        fence_regs(d);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KS; kk++) wgmma_ss_m64n128k16(d, da + 2 * kk, db + 2 * kk);   // 32 bytes a k16 step
        wgmma_commit();
    };

    pdl_wait();                            // xrot and the workspace are the previous kernels'
    if (threadIdx.x == 0) {
        load_x(0);
        if (chunks > 1) load_x(1);
    }
    decode(0);
    mbar_wait(xbars, 0);                   // chunk 0's activations
    fence_async_smem();                    // the decoded stores (generic proxy), visible to wgmma
    __syncthreads();                       // ... and every warp past ring slot 0
    if (threadIdx.x == 0 && TS < chunks) fetch_w(TS);
    issue(0);
    for (int c = 0; c < chunks; c++) {     // chunk c's MMAs in flight
        const bool next = c + 1 < chunks;
        if (next) {
            decode(c + 1);
            mbar_wait(xbars + (c + 1) % S, ((c + 1) / S) & 1);   // chunk c + 1's activations
        }
        fence_async_smem();
        __syncthreads();                   // stage (c + 1) % S written; every warpgroup past chunk c - 1's MMAs
        if (threadIdx.x == 0 && c + 2 < chunks) load_x(c + 2);   // into chunk c - 1's stage
        if (threadIdx.x == 0 && c + 1 + TS < chunks) fetch_w(c + 1 + TS);   // ring slot (c + 1) % TS is read
        if (next) {
            issue(c + 1);
            wgmma_wait<1>();               // chunk c's MMAs (this warpgroup's) are done
            fence_regs(d);
        }
    }
    wgmma_wait<0>();
    fence_regs(d);
    if (rw0 >= nr) return;
    add_wgmma_d<CROWS>(acc, acc64, d, z * rows + rw0, nr - rw0, nt * 16, jb + 4 * ch + (warp & 3), g, t);
}


// wg_body's register A operand over TMA stages with no block barrier in the loop (the 2026-12-06
// 08:39 session; docs/gpu.md "What is left" 2): a block holds 128 columns (8 n-tiles) x a slot of
// 256 rows, in 288 threads. Warps 0-7 are two warpgroups of four n-tiles each: every k-tile a warp
// decodes its own 16 x 16 tile of Ŵᵀ straight into its share of wgmma's A registers (wg_body's
// way: no store, no proxy fence), and the warpgroup's m64n256k16 multiplies those 64 columns by
// the whole slot, WGR_AS - 1 MMAs in flight behind the newest. Warp 8 produces: the block's q-th
// chunk (4 k-tiles) goes to stage q % WGR_S, the slot's 256 rows x 64 k of x (one TMA box in the
// 128-byte swizzle, wga's layout; wg_body's unswizzled core matrices were what made wga's first
// version 5x slower) and the block's trellis words of those k-tiles (bulk copies), completing on
// the stage's full mbarrier. As soon as a warp's waits show chunk q - 1's MMAs done (after its MMA
// WGR_AS - 2 of chunk q, or at the end of a segment), its lane 0 arrives on that stage's empty
// mbarrier, which the producer waits for (8 arrivals) before refilling it. So warps meet only at
// the stages: a warpgroup can run up to WGR_S - 1 chunks ahead of the other. A block's work is a
// list of segments (WgrSeg: a tile's chunks c0..c1 - 1, each segment its own accumulators and
// epilogue, the one ring across them): one, the split block_units gives (exl3_wgr_*), or the
// block's share of all slots' tiles x chunks (exl3_wgr_sk_*, stream-K: a 1-D grid of one block an
// SM, so no SM idles when the tiles are not a multiple of the SMs). Registers (ptxas, sm_90a):
// 162-165 (stream-K 167-168) with no spills at every K and codebook; at WGR_AS 4 ptxas serialized
// the MMAs for registers (C7512: a 288-thread block leaves 168 a thread), and with the producer's
// copies on thread 0 inside the loop of a 256-thread block it serialized them for accumulators
// moved around that branch (C7515). exl3_wgr_rg_out_* is the default route of dense linears of
// 65-1024 rows and 16 M weights or more (cuda_exl3.WGR_MIN_WEIGHTS; EXL3TOOLS_DENSE_WGR=0 opts
// out); the others: bench/gpu_gemm_ab.py's rows and tests/gpu. H100, 2026-12-06 09:49 (graph
// replays, K 3, 256 rows, 4096 -> 14336, kernels alone by torch.profiler): exl3_wgr_out 64 µs (fp16 cuBLAS 55); with
// the bench defines, no loads 52.6, no loads and no decode (the MMAs alone) 45.3: the decode and
// the loads each leave the tensor pipe idle for part of the time.
#ifndef WGR_S
#define WGR_S 5   // stages (cuda_launch.WGR_SMEM holds 5)
#endif
#ifndef WGR_AS
#define WGR_AS 2  // A operands in registers: WGR_AS - 1 MMAs in flight behind the newest (2 or 4)
#endif
#ifndef WGR_PROBE
// a bench-only build define (wrong results), bits: 1 no MMAs, 2 no decode (the words' loads and
// the stages' waits stay), 4 no loads (the producer idles, the consumers neither wait nor arrive:
// stale shared memory)
#define WGR_PROBE 0
#endif
// A segment of a wgr block's work: the chunks [c0, c1) (KS k-tiles each, from k-tile i0) of one
// tile, slot z's rows x the 128 columns from n-tile jb, expert e, nr valid rows
struct WgrSeg {
    int z, e, nr, jb, i0, c0, c1;
};
// stream-K (exl3_wgr_sk_*): the slots x col_blocks (n_groups / 4) tiles x C chunks of work, in that order,
// cut into gridDim.x equal shares; the share's next segment from item on (false: none left). A
// slot of no expert or rows is skipped whole, by the producer and the consumers alike.
__device__ __forceinline__ bool wgr_next(long long& item, long long end, int C, int col_blocks,
                                         const int* __restrict__ slot_exp, const int* __restrict__ tile_n, int rows,
                                         WgrSeg& sg) {
    while (item < end) {
        const int tile = (int)(item / C), c0 = (int)(item % C);
        const int c1 = (int)min((long long)C, c0 + (end - item));
        item += c1 - c0;
        const int z = tile / col_blocks;
        const int e = slot_exp ? slot_exp[z] : 0, nr = tile_n ? min(rows, tile_n[z]) : rows;
        if (e < 0 || nr <= 0) continue;
        sg = WgrSeg{z, e, nr, (tile % col_blocks) * 8, 0, c0, c1};
        return true;
    }
    return false;
}
// wgr_body's fused output pass (exl3_wgr_out_*: a tile's whole k-range, its K splits added by
// wgr_fixup first): the sums (the block's 128 columns x MROWS rows, fp32) are in shared memory
// over the drained stages (wgr_stage, or wgr_fixup for the rows a split finishes); each warp takes
// whole rows m0.. m1 as tiles_epilogue does (lane L: columns 4L..4L+3, H128 across the warp,
// 1/sqrt(128), svh, bias) and writes y: had_out_body's operations in its order on the sums acc
// would have held, so y is bit-identical to gemv + had_out's. Columns are XOR-swizzled by
// ((m >> 1) & 3) * 8 in row m, so a fragment store hits 32 banks and a row's read stays whole float4s.
// (d[4i + q] of thread (warp, g, t): row 8i + 2t + (q & 1), column 16 warp + g + 8 (q >> 1).)
__device__ __forceinline__ int wgr_ts_index(int i, int q, int warp, int g, int t) {
    return (8 * i + 2 * t + (q & 1)) * 128 + ((16 * warp + g + 8 * (q >> 1)) ^ (t << 3));
}
template <int MROWS>
__device__ __forceinline__ void wgr_stage(const float (&d)[MROWS / 2], float* __restrict__ ts, int lane, int warp) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < MROWS / 8; i++)
#pragma unroll
        for (int q = 0; q < 4; q++) ts[wgr_ts_index(i, q, warp, g, t)] = d[4 * i + q];
}
template <typename TY>
__device__ __forceinline__ void wgr_rows(const float* __restrict__ ts, TY* __restrict__ y, const half* __restrict__ svh,
                                         const half* __restrict__ bias, int row0, int m0, int m1, int n, int col0,
                                         int lane, int warp) {
    float sv[4], bv[4] = {0.f, 0.f, 0.f, 0.f};
    load4(svh + col0 + 4 * lane, sv);
    if (bias) load4(bias + col0 + 4 * lane, bv);
    for (int m = m0 + warp; m < m1; m += 8) {
        float v[4];
        load4(ts + m * 128 + ((4 * lane) ^ (((m >> 1) & 3) << 3)), v);
        fwht128(v);
#pragma unroll
        for (int q = 0; q < 4; q++) v[q] = v[q] * 0.08838834764831845f * sv[q] + bv[q];
        store4(y + (size_t)(row0 + m) * n + col0 + 4 * lane, v);
    }
}
// slot z's expert read again after setmaxnreg (exl3_wgr_rg_*): a value kept across it from
// before was spilled by ptxas (4 bytes, both regions); a volatile load is not merged with the first
__device__ __forceinline__ int wgr_expert(const int* __restrict__ slot_exp, int z) {
    return slot_exp ? *reinterpret_cast<const volatile int*>(slot_exp + z) : 0;
}
// Split K inside exl3_wgr_out_* (kps < kt): a tile's splits meet here. Every split stores its sums
// in scratch (its own MROWS x 128 floats, as [i][thread] float4s: coalesced) and counts itself in
// flags[tile] (acq_rel); the last to arrive finishes the whole tile (i0.. i1: all its row groups),
// its own sums from shared memory (ts) and the others' from scratch, added in split order, so y
// depends on the split count alone (not on timing, as atomics would), into ts for wgr_rows; it
// re-zeroes the count for the next launch, and the others leave with no rows. Nothing waits, so it
// is safe whatever is resident: more splits than one wave, MPS, other kernels on the SMs. (It
// replaced, at the same time on the H100, a fixup whose splits each waited for all the others and
// then finished an even share of the rows, safe only within one wave: docs/gpu-sessions.md, the 2026-12-06
// 16:56 session.) The (row group, split) pairs' indices are stepped, not divided out of a running
// count by the runtime split count (the rg kernel's SASS 4264 -> 3168 instructions, IMAD.HI 103 -> 3).
// LOADS: loads in flight a thread (32 spill at 168 registers: 16 outside the rg kernel).
// a 0/1 of thread 0 to every thread of the 256 consumers (bar.red: a barrier and an OR in one)
__device__ __forceinline__ int consumers_or(int v) {
    int r;
    asm volatile("{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, 1, 256, p;\n"
                 " selp.s32 %0, 1, 0, q;\n}\n" : "=r"(r) : "r"(v) : "memory");
    return r;
}
template <int MROWS, int LOADS>
__device__ __forceinline__ void wgr_fixup(const float (&d)[MROWS / 2], int* __restrict__ flags,
                                          float* __restrict__ scratch, float* __restrict__ ts, int tile, int split,
                                          int splits, int lane, int warp, int& i0, int& i1) {
    constexpr int V = MROWS / 8;           // float4s a thread
    const int tid = threadIdx.x;           // (the consumers: 0-255)
    const float4* const base = reinterpret_cast<const float4*>(scratch) + (size_t)tile * splits * V * 256 + tid;
    float4* const dst = reinterpret_cast<float4*>(scratch) + (size_t)(tile * splits + split) * V * 256 + tid;
#pragma unroll
    for (int i = 0; i < V; i++) __stcg(dst + i * 256, make_float4(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]));
    __threadfence();
    named_sync(1, 256);
    int last = 0;
    if (tid == 0) {
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(flags + tile) : "memory");
        last = old == splits - 1;
        if (last) flags[tile] = 0;         // (every split has counted: none reads it again this launch)
    }
    if (!consumers_or(last)) {             // (uniform: the caller's wgr_rows gets no rows)
        i0 = i1 = 0;
        return;
    }
    i0 = 0;
    i1 = V;
    wgr_stage<MROWS>(d, ts, lane, warp);   // (each thread reads back only its own values)
    const int g = lane >> 2, t = lane & 3, n = (i1 - i0) * splits;   // (row group, split) pairs, split fastest
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [&](const float4& v, int s, int i) {   // pair (i, s): its sums, in split order
        if (s == 0) {
            sum = v;
        } else {
            sum.x += v.x;
            sum.y += v.y;
            sum.z += v.z;
            sum.w += v.w;
        }
        if (s == splits - 1) {
            ts[wgr_ts_index(i, 0, warp, g, t)] = sum.x;
            ts[wgr_ts_index(i, 1, warp, g, t)] = sum.y;
            ts[wgr_ts_index(i, 2, warp, g, t)] = sum.z;
            ts[wgr_ts_index(i, 3, warp, g, t)] = sum.w;
        }
    };
    for (int u0 = 0, i = i0, s = 0; u0 < n; u0 += LOADS) {   // ((i, s) stepped, not divided out)
        float4 v[LOADS];
#pragma unroll
        for (int k = 0, ik = i, sk = s; k < LOADS; k++) {
            if (u0 + k >= n) break;
            if (sk == split)               // (this thread's own values, staged above)
                v[k] = make_float4(ts[wgr_ts_index(ik, 0, warp, g, t)], ts[wgr_ts_index(ik, 1, warp, g, t)],
                                   ts[wgr_ts_index(ik, 2, warp, g, t)], ts[wgr_ts_index(ik, 3, warp, g, t)]);
            else
                v[k] = __ldcg(base + (size_t)(sk * V + ik) * 256);
            if (++sk == splits) sk = 0, ik++;
        }
#pragma unroll
        for (int k = 0; k < LOADS; k++) {
            if (u0 + k >= n) break;
            add(v[k], s, i);
            if (++s == splits) s = 0, i++;
        }
    }
}
// OUT 0: partial sums into acc with atomics (had_out follows); OUT 1 / 2 (not stream-K): the output
// pass fused (wgr_rows), y fp16 / fp32, a tile's K splits (kps < kt) added by wgr_fixup first.
// (Clusters of two blocks sharing x by TMA multicast, a producer's handshake with the other
// block's before each refill, measured slower: docs/gpu-sessions.md, the 2026-12-06 09:49 session.) AS: A
// operands in registers (AS - 1 MMAs in flight behind the newest). RG (exl3_wgr_rg_*, 384 threads): the producer warp is a warpgroup of its
// own that gives its registers to the consumers (setmaxnreg: 40 a thread there, 232 here; 168 at
// launch), so four A operands fit without ptxas serializing the MMAs (C7512 at 168), and a
// chunk's decode runs with three MMAs queued ahead of it instead of one.
template <int MROWS, bool SK, int OUT = 0, int AS = WGR_AS, bool RG = false>
__device__ __forceinline__ void wgr_body(const uint64_t* __restrict__ trellis_ptrs, const int* __restrict__ slot_exp,
                                         float* __restrict__ acc, unsigned long long* __restrict__ acc64, int rows,
                                         int kt, int nt, int kps, int n_groups, int n_units,
                                         const int* __restrict__ tile_n, const CUtensorMap& xmap, int slots,
                                         void* __restrict__ y = nullptr, const uint64_t* __restrict__ svh_ptrs = nullptr,
                                         const uint64_t* __restrict__ bias_ptrs = nullptr, int* __restrict__ flags = nullptr,
                                         float* __restrict__ scratch = nullptr) {
    constexpr int KS = 4, S = WGR_S;
    static_assert(MROWS == 256 || MROWS == 128, "m64n256 / m64n128: one warpgroup's MMA takes the whole slot");
    static_assert(S >= 2 && S <= 5, "stages (cuda_launch.WGR_SMEM)");
    static_assert(OUT == 0 || (!SK && S * MROWS * 64 * 2 >= MROWS * 128 * 4), "the epilogue: one segment, sums over the x stages");
    static_assert(AS >= 2 && KS % AS == 0, "A operands: the same one every AS k-tiles, across chunks too");
    constexpr int X_STAGE = MROWS * 64, W_SLOT = KS * 8 * NW;       // halves; uint32
    constexpr int STAGE_TX = X_STAGE * 2 + W_SLOT * 4;              // bytes a stage's copies bring
    // [S][X_STAGE] halves (1024-byte aligned: the swizzle), [S][W_SLOT] uint32, S full + S empty mbarriers
    extern __shared__ __align__(1024) unsigned char wgr_smem[];
    half* const xs = reinterpret_cast<half*>(wgr_smem);
    uint32_t* const ws = reinterpret_cast<uint32_t*>(xs + S * X_STAGE);
    uint64_t* const full = reinterpret_cast<uint64_t*>(ws + S * W_SLOT);
    uint64_t* const empty = full + S;
    pdl_launch_dependents();
    // the block's segments: plain, the one block_units gives (the grid's (unit block, slot));
    // stream-K, its share of all the work (kps: kt, every tile's whole k-range)
    WgrSeg sg;
    long long item = 0, end = 0;
    const int C = kt / KS, col_blocks = n_groups / 4;
    bool more;
    if constexpr (SK) {
        pdl_wait();                        // (its share may begin in any slot: the tables first)
        const long long work = (long long)slots * col_blocks * C;
        item = work * blockIdx.x / gridDim.x;
        end = work * (blockIdx.x + 1) / gridDim.x;
        more = wgr_next(item, end, C, col_blocks, slot_exp, tile_n, rows, sg);
    } else {
        int i1;
        sg.z = blockIdx.y;
        more = block_units(slot_exp, tile_n, rows, kt, kps, n_groups, n_units, sg.i0, i1, sg.e, sg.nr, sg.jb);
        sg.c0 = 0;
        sg.c1 = (i1 - sg.i0) / KS;         // (i1 - i0) % 4 == 0
    }
    if (!more) return;                     // the whole block, before any barrier
    auto next = [&]() -> bool {
        if constexpr (SK) return wgr_next(item, end, C, col_blocks, slot_exp, tile_n, rows, sg);
        return false;
    };
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < S; i++) {
            mbar_init(full + i, 1);
            mbar_init(empty + i, 8);       // lane 0 of each consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();                       // (the last block-wide barrier: warp 8 leaves early)
    // stage and parity of a chunk come from q, the block's running count of chunks over its
    // segments, so one ring serves them all

    if (RG ? warp >= 8 : warp == 8) {      // ---- the producer (RG: its warpgroup)
        if constexpr (RG) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if ((RG && warp != 8) || lane != 0 || (WGR_PROBE & 4)) return;
        if constexpr (RG) sg.e = wgr_expert(slot_exp, sg.z);
        pdl_wait();                        // xrot is the previous kernel's
        const size_t row_stride = (size_t)nt * NW;
        int q = 0;
        do {
            const uint32_t* const trb = reinterpret_cast<const uint32_t*>(trellis_ptrs[sg.e]) +
                                        (size_t)sg.i0 * row_stride + (size_t)sg.jb * NW;
            for (int c = sg.c0; c < sg.c1; c++, q++) {
                uint64_t* const bar = full + q % S;
                if (q >= S) mbar_wait(empty + q % S, (q / S - 1) & 1);   // chunk q - S's MMAs done in both warpgroups
                mbar_arrive_tx(bar, STAGE_TX);
                chunk_words<KS>(ws + (q % S) * W_SLOT, trb, row_stride, c, bar);
                tma_2d(xs + (q % S) * X_STAGE, &xmap, (sg.i0 + KS * c) * 16, sg.z * rows, bar);
            }
        } while (next());
        return;
    }

    // ---- the consumers: warp w decodes n-tile w of the block (rows 16 (w % 4).. of its
    // warpgroup's A: columns 64 (w / 4) + 16 (w % 4)..), lane words (word + m) % NW of each tile
    if constexpr (RG) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        sg.e = wgr_expert(slot_exp, sg.z);
    }
    pdl_wait();                            // the workspace acc is the previous kernels'
    const int g = lane >> 2, t = lane & 3;
    int wi[NL], off;
    staged_lane_words(lane, wi, off);
    const Consts kc;
    // A operand kk % AS: the MMA that last read it was issued AS groups earlier, so the wait
    // behind the newest (AS - 1 in flight) has seen it done before the decode overwrites it
    uint32_t a[AS][4], sink = 0;
    const uint64_t db0 = sw128_desc(xs, 16, 1024);   // a stage or k16 step on: an addition (bytes / 16)
    int q = 0;
    do {
        float d[MROWS / 2];
#pragma unroll
        for (int i = 0; i < MROWS / 2; i++) d[i] = 0.f;
        for (int c = sg.c0; c < sg.c1; c++, q++) {
            const int s = q % S;
            if constexpr (!(WGR_PROBE & 4)) mbar_wait(full + s, (q / S) & 1);
            const uint32_t* const wsl = ws + s * W_SLOT + warp * NW;
            const uint64_t db = db0 + s * (X_STAGE * 2 / 16);
#pragma unroll
            for (int kk = 0; kk < KS; kk++) {
                uint32_t w[NL], b[4];
#pragma unroll
                for (int m = 0; m < NL; m++) w[m] = wsl[kk * 8 * NW + wi[m]];
                if constexpr ((WGR_PROBE & 2) != 0) {
#pragma unroll
                    for (int i = 0; i < 4; i++) b[i] = w[i % NL];
                } else {
                    decode_tile(kc, w, off, b);
                }
                uint32_t (&ak)[4] = a[kk % AS];
                ak[0] = b[0]; ak[1] = b[2]; ak[2] = b[1]; ak[3] = b[3];
                if constexpr ((WGR_PROBE & 1) != 0) {
                    sink ^= ak[0] ^ ak[1] ^ ak[2] ^ ak[3];   // (ptxas drops a decode nothing reads)
                } else {
                    fence_regs(d);
                    wgmma_fence();
                    wgmma_k16<MROWS>(d, ak, db + 2 * kk);   // 32 bytes a k16 step
                    wgmma_commit();
                    wgmma_wait<AS - 1>();
                    fence_regs(d);
                }
                // AS - 1 of this chunk's MMAs may still run: the segment's chunk before is done
                if (kk == AS - 2 && c > sg.c0 && lane == 0 && !(WGR_PROBE & 4)) mbar_arrive(empty + (q - 1) % S);
            }
        }
        wgmma_wait<0>();
        fence_regs(d);
        if (lane == 0 && !(WGR_PROBE & 4)) mbar_arrive(empty + (q - 1) % S);     // the segment's last chunk is done too
        if constexpr ((WGR_PROBE & 1) != 0) d[0] = sink == 0x9e3779b9u ? 1.f : d[0];
        if constexpr (OUT == 0) {
            add_wgmma_d<MROWS>(acc, acc64, d, sg.z * rows, sg.nr, nt * 16, sg.jb + warp, g, t);
        } else {
            float* const ts = reinterpret_cast<float*>(wgr_smem);
            int i0 = 0, i1 = MROWS / 8;
            named_sync(1, 256);            // both warpgroups' MMAs are done reading the stages
            if (kps < kt)
                wgr_fixup<MROWS, RG ? 32 : 16>(d, flags, scratch, ts, sg.z * col_blocks + sg.jb / 8, sg.i0 / kps, (kt + kps - 1) / kps,
                                 lane, warp, i0, i1);
            else
                wgr_stage<MROWS>(d, ts, lane, warp);
            named_sync(1, 256);
            using TY = typename std::conditional<OUT == 1, half, float>::type;
            wgr_rows<TY>(ts, reinterpret_cast<TY*>(y), reinterpret_cast<const half*>(svh_ptrs[sg.e]),
                         bias_ptrs ? reinterpret_cast<const half*>(bias_ptrs[sg.e]) : nullptr, sg.z * rows, 8 * i0,
                         min(sg.nr, 8 * i1), nt * 16, sg.jb * 16, lane, warp);
        }
    } while (next());
}
