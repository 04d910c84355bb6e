// EXL3 trellis kernels for Hopper (sm_90a): skinny GEMM (rows <= 64, dense or one row per MoE
// slot), MoE prefill tiles with the activations in shared memory (their bodies in
// exl3_tiles.cuh, included below), bit-exact decode of Ŵ, and the two 128-point Hadamard passes. exl3-format.md §5 is the
// spec; kernels/reference.py is the oracle the tests compare against.
//
// One module is built per (K2, CB) (-DK2=..., -DCB=...): K2 = trellis width / 8 (2K for integer
// K, 2K+1 for half-integer K); CB 0 = 3INST, 1 = MCG, 2 = MUL1. Everything below that depends on
// them is a compile-time constant, which is the point: no per-weight index math survives.
//
// Why it is fast. A warp owns whole 16x16 tiles; lane L holds trellis steps 8L..8L+7, which the
// encoder's permutation (§5.5) places exactly in the mma.m16n8k16 B-fragment of lane L. The 16-bit
// window of step 8L+e starts at a lane-dependent bit, but relative to the lane's first window it
// starts at D(e) = ((e+1)K2 >> 1) - (K2 >> 1), a constant. So each lane loads the 2-4 words that
// cover its windows, shifts them once so its first window starts at bit 0 ("normalise", 1-3
// funnel shifts per tile), and then extracts every state with constant shifts: about 2 integer ops
// per state, 1 multiply, 1 dp4a (MUL1) or LOP3 (3INST/MCG), and half an fp16 op, then the MMA.

#include <cuda.h>        // CUtensorMap (exl3_wga_*'s activations)
#include <cuda_fp16.h>
#include <type_traits>
#include <stdint.h>

#ifndef K2
#define K2 6
#endif
#ifndef CB
#define CB 2
#endif
#ifndef HALVES
// 1: the halves gemv (gemv_body at 8 rows; cuda_build.halves): 3INST / MCG with EXL3TOOLS_GEMV_HALVES
// (the default), MUL1 with EXL3TOOLS_GEMV_AFFINE (the default; at up to 4 rows, AFF below)
#define HALVES 0
#endif
#ifndef XDUP_SMEM
// 1: the halves kernels with their own input pass (PRO; MUL1's AFF ones too) keep each rotated
// activation in shared memory as the B words it feeds (3INST / MCG (x, x); AFF (x, 0) and (0, x)),
// a lane's four of a k-step in one 16-byte load (step), instead of two loads and four PRMTs; a
// tuning A/B's define (cuda_gemv.gemv_pro sizes the split for it)
#define XDUP_SMEM 0
#endif

namespace {

constexpr int NW = 4 * K2;           // uint32 words per tile
constexpr int RING = 128 * K2;       // bits per tile
__host__ __device__ constexpr int D(int e) { return (((e + 1) * K2) >> 1) - (K2 >> 1); }
constexpr int SPAN = D(7) + 16;      // bits one lane needs
constexpr int NN = (SPAN + 31) / 32; // normalised words per lane
constexpr int NL = NN + 1;           // loaded words per lane (the first window is unaligned)

// ------------------------------------------------------------------ bit helpers (host-testable)
__host__ __device__ __forceinline__ uint32_t fsl(uint32_t lo, uint32_t hi, uint32_t s) {
    // upper 32 bits of (hi:lo) << s, s in [0, 32]
#ifdef __CUDA_ARCH__
    return __funnelshift_lc(lo, hi, s);
#else
    return s == 0 ? hi : s >= 32 ? lo : (hi << s) | (lo >> (32 - s));
#endif
}

__host__ __device__ __forceinline__ uint32_t fsr(uint32_t lo, uint32_t hi, uint32_t s) {
    // lower 32 bits of (hi:lo) >> s, s in [0, 32)
#ifdef __CUDA_ARCH__
    return __funnelshift_r(lo, hi, s);
#else
    return s == 0 ? lo : (lo >> s) | (hi << (32 - s));
#endif
}

// Ring position where lane L's first window starts, as (word, bit offset) of the tile.
__host__ __device__ __forceinline__ void lane_origin(int lane, int& word, int& off) {
    int start = 4 * lane * K2 + (K2 >> 1) - 16;   // S(8L) - 16, may be negative (tail-biting)
    start = (start + RING) % RING;
    word = start >> 5;
    off = start & 31;
}

// The 16-bit window starting at normalised bit Q (MSB-first stream n[0] n[1] ...).
template <int Q>
__host__ __device__ __forceinline__ uint32_t window(const uint32_t (&n)[NN]) {
    constexpr int q = Q >> 5, r = Q & 31;
    if constexpr (r == 0) {
        return n[q] >> 16;
    } else if constexpr (r == 16) {
        return n[q] & 0xffffu;
    } else if constexpr (r < 16) {
        return (n[q] >> (16 - r)) & 0xffffu;
    } else {
        return fsr(n[q + 1], n[q], 48 - r) & 0xffffu;
    }
}

// The 8 states of lane L from the words it loaded (w[m] = tile word (word + m) mod NW).
__host__ __device__ __forceinline__ void lane_states(const uint32_t (&w)[NL], int off, uint32_t (&s)[8]) {
    uint32_t n[NN];
#pragma unroll
    for (int q = 0; q < NN; q++) n[q] = fsl(w[q + 1], w[q], off);
    s[0] = window<D(0)>(n);
    s[1] = window<D(1)>(n);
    s[2] = window<D(2)>(n);
    s[3] = window<D(3)>(n);
    s[4] = window<D(4)>(n);
    s[5] = window<D(5)>(n);
    s[6] = window<D(6)>(n);
    s[7] = window<D(7)>(n);
}

#ifndef EXL3_HOST_TEST
// ------------------------------------------------------------------ codebooks (two states -> half2)
// Loop-invariant operands held in registers the compiler cannot rematerialise (it otherwise
// re-creates them with a MOV in every unrolled stage).
struct Consts {
#if CB == 2
    uint32_t ones, bias, kappa;
#if HALVES
    uint32_t bias1;   // AFF: fp16 1.0 in the high half, so dp4a leaves (1024 + byte sum, 1.0)
#endif
    __device__ __forceinline__ Consts() {
        asm volatile("mov.b32 %0, 0x01010101;" : "=r"(ones));
        asm volatile("mov.b32 %0, 0x00006400;" : "=r"(bias));
        asm volatile("mov.b32 %0, 0x1EEE1EEE;" : "=r"(kappa));
#if HALVES
        asm volatile("mov.b32 %0, 0x3C006400;" : "=r"(bias1));
#endif
    }
#else
    // 3INST / MCG: the mask in a register, so (x & mask) ^ 0x3B603B60 is one LOP3 (one LOP3 takes
    // at most one immediate: with both it is two)
    uint32_t mask;
    __device__ __forceinline__ Consts() {
        asm volatile("mov.b32 %0, 0x8FFF8FFF;" : "=r"(mask));
    }
#endif
};

// (a & b) ^ 0x3B603B60 in one LOP3 (lut 0xF0 & 0xCC ^ 0xAA)
__device__ __forceinline__ uint32_t and_flip(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, 0x3B603B60, 0x6A;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ uint32_t pair(const Consts& k, uint32_t s0, uint32_t s1) {
#if CB == 2
    const uint32_t x0 = s0 * 0x83DCD12Du, x1 = s1 * 0x83DCD12Du;
    const uint32_t h0 = __dp4a(x0, k.ones, k.bias);   // fp16 bits of 1024 + byte sum
    const uint32_t h1 = __dp4a(x1, k.ones, k.bias);
    uint32_t p = __byte_perm(h0, h1, 0x5410);
    half2 v = __hfma2(*reinterpret_cast<half2*>(&p), *reinterpret_cast<const half2*>(&k.kappa),
                      __halves2half2(__ushort_as_half(0xC931), __ushort_as_half(0xC931)));
    return *reinterpret_cast<uint32_t*>(&v);
#else
#if CB == 0
    uint32_t x0 = s0 * 89226354u + 64248484u, x1 = s1 * 89226354u + 64248484u;
#else
    uint32_t x0 = s0 * 0xCBAC1FEDu, x1 = s1 * 0xCBAC1FEDu;
#endif
    x0 = and_flip(x0, k.mask);
    x1 = and_flip(x1, k.mask);
    uint32_t lo = __byte_perm(x0, x1, 0x5410), hi = __byte_perm(x0, x1, 0x7632);
    half2 v = __hadd2(*reinterpret_cast<half2*>(&lo), *reinterpret_cast<half2*>(&hi));
    return *reinterpret_cast<uint32_t*>(&v);
#endif
}

#if HALVES
// 3INST / MCG: a weight is the fp16 sum of the two halves of its hashed state (pair's HADD2). With
// HALVES the MMA adds them instead: the state's half2 goes into the A fragment as two k entries and
// the activation goes in twice (gemv_body), so a tile takes two MMAs and no PRMT / HADD2 (two
// PRMTs and an HADD2 a pair saved, four PRMTs a k-step for the duplicated activations spent).
// The sum is then exact in the fp32 accumulator, where pair rounds it to fp16 first.
// MUL1 (AFF): a weight is kappa * h + beta, h = 1024 + the byte sum (pair's PRMT and HFMA2). Here the
// state's A entries are (h, 1.0) and activation row r feeds two B columns, (x, 0) at 2r and (0, x)
// at 2r + 1: the MMA leaves sum x * h at column 2r and sum x at 2r + 1, and the epilogue applies
// kappa and beta once a split (add_fragments_aff). No PRMT or HFMA2 a pair; the affine is exact in
// fp32 where pair rounds each weight to fp16.
__device__ __forceinline__ uint32_t halves(const Consts& k, uint32_t s) {
#if CB == 0
    return and_flip(s * 89226354u + 64248484u, k.mask);
#elif CB == 1
    return and_flip(s * 0xCBAC1FEDu, k.mask);
#else
    return __dp4a(s * 0x83DCD12Du, k.ones, k.bias1);
#endif
}
constexpr float AFF_KAPPA = 1774.f / 262144.f;   // fp16 0x1EEE, reference.MUL1_KAPPA
constexpr float AFF_BETA = -10.3828125f;         // fp16 0xC931
#endif

// B fragments of one tile: b[0], b[1] for columns 0-7, b[2], b[3] for columns 8-15 (§5.5).
__device__ __forceinline__ void decode_tile(const Consts& k, const uint32_t (&w)[NL], int off, uint32_t (&b)[4]) {
    uint32_t s[8];
    lane_states(w, off, s);
    b[0] = pair(k, s[0], s[1]);
    b[1] = pair(k, s[2], s[3]);
    b[2] = pair(k, s[4], s[5]);
    b[3] = pair(k, s[6], s[7]);
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void red1(float* p, float a) {
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(a) : "memory");
}

// Batch-invariant partial sums: a split's fp32 partial as a fixed-point int64 (x 2^32, rounded
// once), added with an integer atomic. Integer sums do not depend on the order the splits arrive
// in, so with the splits fixed by the shape (cuda_gemv.gemv) a row's result depends on the row
// alone, never on the other rows or slots of the launch (fp32 atomics of 3+ splits round by arrival).
// Range 2^31, resolution 2^-32: far beyond fp16 outputs at any activation scale the models reach.
// (A NaN or infinite partial saturates here rather than propagating.)
#define FIX_SCALE 4294967296.f
#define FIX_INV 2.3283064365386963e-10f
__device__ __forceinline__ void red_fixed(unsigned long long* p, float a) {
    const unsigned long long v = (unsigned long long)__float2ll_rn(a * FIX_SCALE);
    asm volatile("red.global.add.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint32_t ldg32(const uint32_t* p) { return __ldg(p); }

// predicated load: v keeps its value when !pred (no branch around the load). Not volatile: the
// data is read-only for the kernel's lifetime, so the compiler may schedule it freely.
__device__ __forceinline__ void ldg32_if(uint32_t& v, const uint32_t* p, bool pred) {
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.nc.u32 %0, [%1];\n}\n"
        : "+r"(v) : "l"(p), "r"((int)pred));
}

// Programmatic dependent launch (Hopper): a kernel launched with the PDL attribute may start while
// its predecessor still runs; it must wait before touching what the predecessor writes.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// ------------------------------------------------------------------ shared by the GEMM bodies
// The lane's running pointers to its NL words of the first tile of n-tile j0 at k-tile i0; each
// load_tiles call reads one tile row (NT n-tiles) and advances them a tile row (loads go in k order).
__device__ __forceinline__ void weight_ptrs(const uint32_t* tr, int i0, size_t row_stride, int j0, int word,
                                            const uint32_t* (&wp)[NL]) {
#pragma unroll
    for (int m = 0; m < NL; m++) wp[m] = tr + (size_t)i0 * row_stride + (size_t)j0 * NW + (word + m) % NW;
}
template <int NT>
__device__ __forceinline__ void load_tiles(uint32_t (&wb)[NT][NL], const uint32_t* (&wp)[NL], size_t row_stride,
                                           bool pred) {
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int m = 0; m < NL; m++) ldg32_if(wb[j][m], wp[m] + j * NW, pred);
#pragma unroll
    for (int m = 0; m < NL; m++) wp[m] += row_stride;
}
template <int MB, int NT>
__device__ __forceinline__ void zero_fragments(float (&c)[MB][NT][4]) {
#pragma unroll
    for (int mb = 0; mb < MB; mb++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) c[mb][j][q] = 0.f;
}
// acc rows row0 + m (m < valid) += the D fragments: d0, d1 = n g, rows 2t, 2t+1; d2, d3 = n g + 8, same rows
template <int MB, int NT, typename TA>
__device__ __forceinline__ void add_fragments_to(TA* __restrict__ acc, const float (&c)[MB][NT][4], int row0,
                                                 int valid, int n, int j0, int g, int t) {
#pragma unroll
    for (int mb = 0; mb < MB; mb++)
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int m = 8 * mb + 2 * t + q;
            if (m >= valid) continue;
            TA* out = acc + (size_t)(row0 + m) * n + (size_t)j0 * 16 + g;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                if constexpr (sizeof(TA) == 8) {
                    red_fixed(out + 16 * j, c[mb][j][q]);
                    red_fixed(out + 16 * j + 8, c[mb][j][2 + q]);
                } else {
                    red1(out + 16 * j, c[mb][j][q]);
                    red1(out + 16 * j + 8, c[mb][j][2 + q]);
                }
            }
        }
}
// into the fp32 workspace, or (acc64 given) the fixed-point one of batch-invariant runs
template <int MB, int NT>
__device__ __forceinline__ void add_fragments(float* __restrict__ acc, unsigned long long* __restrict__ acc64,
                                              const float (&c)[MB][NT][4], int row0, int valid, int n, int j0,
                                              int g, int t) {
    if (acc64)
        add_fragments_to<MB, NT>(acc64, c, row0, valid, n, j0, g, t);
    else
        add_fragments_to<MB, NT>(acc, c, row0, valid, n, j0, g, t);
}

#if HALVES && CB == 2
// AFF (MUL1 halves, rows <= 4): lane t holds row t's sum x * h (d0, d2: n g, g + 8) beside its sum
// x (d1, d3); acc row row0 + t += kappa * (x · h) + beta * (sum x), the split's partial of x · Ŵ
template <int NT>
__device__ __forceinline__ void add_fragments_aff(float* __restrict__ acc, unsigned long long* __restrict__ acc64,
                                                  const float (&c)[1][NT][4], int row0, int valid, int n, int j0,
                                                  int g, int t) {
    if (t >= valid) return;
    const size_t o = (size_t)(row0 + t) * n + (size_t)j0 * 16 + g;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const float v0 = fmaf(AFF_KAPPA, c[0][j][0], AFF_BETA * c[0][j][1]);
        const float v1 = fmaf(AFF_KAPPA, c[0][j][2], AFF_BETA * c[0][j][3]);
        if (acc64) {
            red_fixed(acc64 + o + 16 * j, v0);
            red_fixed(acc64 + o + 16 * j + 8, v1);
        } else {
            red1(acc + o + 16 * j, v0);
            red1(acc + o + 16 * j + 8, v1);
        }
    }
}
constexpr int AFF_ROWS = 4;   // rows a slot AFF takes (two B columns a row)
#endif

// ------------------------------------------------------------------ skinny GEMM
// Hadamard helpers (defined with the passes below), for the gemv's own input pass (PRO)
template <bool SIGN_FMA = false>
__device__ __forceinline__ void fwht128(float (&v)[4]);
__device__ __forceinline__ void load4(const half* p, float (&v)[4]);
__device__ __forceinline__ void load4(const float* p, float (&v)[4]);
template <typename TX, bool SIGN_FMA = false>
__device__ __forceinline__ void rotate4(const TX* __restrict__ x, const half* __restrict__ suh, float (&v)[4]);
template <typename TX, bool SIGN_FMA = false>
__device__ __forceinline__ void rotate4_act(const TX* __restrict__ x, const TX* __restrict__ u,
                                            const half* __restrict__ suh, float (&v)[4]);
constexpr int PRO_SMEM = 4096;   // uint32 of rotated activations a block holds (PRO): rows x (kps x 8 + 4)

// acc[o, :] += xrot[o, :] @ Ŵ_e for rows o of slot z = blockIdx.y (o = z * rows + m), Ŵ_e from
// trellis_ptrs[slot_exp ? slot_exp[z] : 0] (slot_exp[z] < 0: skip the slot), nt n-tiles of a trellis
// nt tiles wide, or (LD) ld_tab[e] tiles wide. Work unit per warp: NT adjacent n-tiles x a k-range.
// The MMA runs transposed, D(n16 x rows8) = Ŵᵀ(n16 x k16) · xᵀ(k16 x rows8): the lane's decoded
// tile is then exactly its A fragment (one MMA per tile, no zero rows for rows <= 8), and the
// activations are the B fragment. fp32 partials go to acc with atomics; the output pass reads
// acc and re-zeroes it.
//
// PRO (rows <= 8 a slot, NT 2, kps a multiple of 8): no had_in launch before it. The block's four
// warps share one split (column groups come in fours), so they rotate their k-range of each row
// themselves, had_in's arithmetic on raw x (fp16 or fp32: TX) with row o's source row_src[o] and
// sign vector row_exp[o], into shared memory, and take the B fragments from there. PRO 2: the
// input is silu(gate) * up, gate at that row and up act_rows rows further (rotate4_act).
// AFF (HALVES MUL1 modules, rows <= AFF_ROWS): the affine halves above; the entry points choose it.
template <int MROWS, int NT, int P, int PRO = 0, typename TX = half, bool LD = false, bool AFF = false>
__device__ __forceinline__ void gemv_body(const uint32_t* __restrict__ xrot, const uint64_t* __restrict__ trellis_ptrs,
                                          const int* __restrict__ slot_exp, float* __restrict__ acc,
                                          unsigned long long* __restrict__ acc64, int rows,
                                          int kt, int nt, int kps, int n_groups, int n_units,
                                          const TX* __restrict__ x = nullptr, const uint64_t* __restrict__ suh_ptrs = nullptr,
                                          const int* __restrict__ row_src = nullptr,
                                          const int* __restrict__ row_exp = nullptr,
                                          const int* __restrict__ ld_tab = nullptr, int act_rows = 0,
                                          const int* __restrict__ tile_n = nullptr) {
    constexpr int MB = MROWS / 8;          // 8-row blocks
    static_assert(PRO == 0 || (MB == 1 && NT == 2), "the input pass is for 8-row, two-tile units");
    static_assert(!AFF || (HALVES && CB == 2 && MB == 1), "AFF: the MUL1 halves gemv of up to 4 rows");
#if HALVES && CB == 2
    // (more real rows: pair's PRMT and HFMA2). Per slot: expert_groups' 8-row tiles mostly hold
    // 1-2 real rows (tile_n). PRO has entry points of its own for AFF: in one kernel, both paths
    // took 96 registers where each alone takes 72-80
    if constexpr (!AFF && MB == 1 && PRO == 0) {
        if ((tile_n ? min(rows, tile_n[blockIdx.y]) : rows) <= AFF_ROWS) {
            gemv_body<MROWS, NT, P, PRO, TX, LD, true>(xrot, trellis_ptrs, slot_exp, acc, acc64, rows, kt, nt, kps,
                                                       n_groups, n_units, x, suh_ptrs, row_src, row_exp, ld_tab,
                                                       act_rows, tile_n);
            return;
        }
    }
#endif
    __shared__ __align__(16) uint32_t xs[PRO ? PRO_SMEM : 1];
    // XD: xs holds a lane's B words ready: 3INST / MCG dup(x) = (x, x), 16 words a row's k-tile,
    // lane t's dup(k 2t, 2t+1, 2t+8, 2t+9) at 4t; AFF (x, 0) for even columns g, then (0, x) for
    // odd ones 16 words further (32 a row's k-tile)
    constexpr bool XD = XDUP_SMEM && HALVES && PRO != 0 && (CB != 2 || AFF);
    constexpr int XW = CB == 2 ? 32 : 16;
    pdl_launch_dependents();               // the output pass may be scheduled now; it waits for us
    const int lane = threadIdx.x & 31;
    const int unit = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if constexpr (PRO == 0) {
        if (unit >= n_units) return;
    }
    // PRO: a warp past the last unit still takes part in the input pass and its barrier
    const bool live = unit < n_units;
    const int u = live ? unit : blockIdx.x * (blockDim.x >> 5);
    const int z = blockIdx.y;
    const int grp = u % n_groups, split = u / n_groups;
    const int i0 = split * kps;
    const int i1 = min(kt, i0 + kps);
    if (i0 >= i1) return;                  // (PRO: the same for the whole block)
    const int e = slot_exp ? slot_exp[z] : 0;
    if (e < 0) return;                     // an unused tile of a grouped MoE call: no work, acc stays 0
    // tile_n (not with PRO): the slot's real rows; the rest are neither read nor added (the
    // Hadamard passes skip them too), so their acc rows stay zero
    const int valid = tile_n ? min(rows, tile_n[z]) : rows;
    const uint32_t* tr = reinterpret_cast<const uint32_t*>(trellis_ptrs[e]);
    const int g = lane >> 2, t = lane & 3;
    const int k2 = kt * 8;                 // uint32 per activation row
    const int n = nt * 16;

    int word, off;
    lane_origin(lane, word, off);
    const int j0 = grp * NT;
    // uint32 per tile row: LD, the slot's own trellis width (slots that are column chunks of wider
    // linears: q, k and v in one launch), else nt
    const size_t row_stride = (size_t)(LD ? ld_tab[e] : nt) * NW;
    const uint32_t* wp[NL];
    weight_ptrs(tr, i0, row_stride, j0, word, wp);
    // B fragment (xᵀ): lane feeds activation row 8mb + g, k = 2t, 2t+1 and 2t+8, 2t+9 of the tile
    // (AFF: row g / 2, into column g)
    const int xg = AFF ? g >> 1 : g;
    const uint32_t* xr[MB];
    bool xv[MB];
#pragma unroll
    for (int mb = 0; mb < MB; mb++) {
        const int m = 8 * mb + xg;
        xv[mb] = m < valid;
        xr[mb] = xrot + (size_t)(z * rows + (xv[mb] ? m : 0)) * k2 + t + 8 * i0;
    }

    float c[MB][NT][4];
    zero_fragments<MB, NT>(c);

    const Consts kc;
    uint32_t wb[P][NT][NL];
    uint32_t xb[P][MB][2];
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
        for (int mb = 0; mb < MB; mb++) xb[p][mb][0] = xb[p][mb][1] = 0u;
    // loads are predicated, never branched around; pointers advance regardless (never read past)
    auto load_w = [&](int p, bool pred) { load_tiles<NT>(wb[p], wp, row_stride, pred); };
    // PRO: uint32 a row in xs (+4: the rows' fragments on distinct banks; XD: +16, rows g and g + 1
    // of a quarter warp's 16-byte loads on distinct bank halves)
    const int xstride = XD ? kps * XW + 16 : kps * 8 + 4;
    int xo = xg * xstride + t;
    // XD: step's own position, a k-tile a step; a lane past the slot's rows reads row 0 (its output
    // column is never added), so the load needs no predicate and stays inside the rows written
    int xq = (xv[0] ? xg : 0) * xstride + (CB == 2 ? (g & 1) * 16 : 0) + 4 * t;
    auto load_x = [&](int p, bool pred) {
        if constexpr (XD) {
            // (step reads its words itself: nothing to prefetch)
        } else if constexpr (PRO != 0) {
            if (pred && xv[0]) {
                xb[p][0][0] = xs[xo];
                xb[p][0][1] = xs[xo + 4];
            }
            xo += 8;
        } else {
#pragma unroll
            for (int mb = 0; mb < MB; mb++) {
                ldg32_if(xb[p][mb][0], xr[mb], pred && xv[mb]);
                ldg32_if(xb[p][mb][1], xr[mb] + 4, pred && xv[mb]);
                xr[mb] += 8;
            }
        }
    };
#if HALVES
    // the B entries beside a state's two A entries: each activation twice (3INST / MCG: both halves
    // are the weight), or AFF's (x, 0) in even columns and (0, x) in odd ones (MUL1: h, then 1.0);
    // byte 4 of the PRMT is the zero
#if CB == 2
    const uint32_t sel_lo = g & 1 ? 0x1044u : 0x4410u, sel_hi = g & 1 ? 0x3244u : 0x4432u;
#else
    constexpr uint32_t sel_lo = 0x1010u, sel_hi = 0x3232u;
#endif
#endif
    auto step = [&](int p) {
#if HALVES
        if constexpr (CB == 2 ? AFF : MB == 1) {
            // states s0..s7 sit at (n g, k 2t), (g, 2t+1), (g, 2t+8), (g, 2t+9), then n g+8 alike;
            // each state fills the two k entries of one A register (the first MMA: k 2t in entries
            // 2t, 2t+1, k 2t+1 in 2t+8, 2t+9; the second: k 2t+8, 2t+9), its activation the
            // matching B entries
            const uint32_t x0 = xb[p][0][0], x1 = xb[p][0][1];
            uint32_t xd[4];
            if constexpr (XD) {           // XDUP_SMEM: the four words ready in xs
                const uint4 q4 = *reinterpret_cast<const uint4*>(xs + xq);
                xd[0] = q4.x, xd[1] = q4.y, xd[2] = q4.z, xd[3] = q4.w;
                xq += XW;
            } else {
                xd[0] = __byte_perm(x0, 0, sel_lo), xd[1] = __byte_perm(x0, 0, sel_hi);
                xd[2] = __byte_perm(x1, 0, sel_lo), xd[3] = __byte_perm(x1, 0, sel_hi);
            }
#pragma unroll
            for (int j = 0; j < NT; j++) {
                uint32_t st[8], h[8];
                lane_states(wb[p][j], off, st);
#pragma unroll
                for (int q = 0; q < 8; q++) h[q] = halves(kc, st[q]);
                const uint32_t a0[4] = {h[0], h[4], h[1], h[5]}, a1[4] = {h[2], h[6], h[3], h[7]};
                mma(c[0][j], a0, xd[0], xd[1]);
                mma(c[0][j], a1, xd[2], xd[3]);
            }
        } else
#endif
        {
#pragma unroll
            for (int j = 0; j < NT; j++) {
                uint32_t b[4];
                decode_tile(kc, wb[p][j], off, b);
                const uint32_t a[4] = {b[0], b[2], b[1], b[3]};   // (n g | g+8) x (k 2t.. | 2t+8..)
#pragma unroll
                for (int mb = 0; mb < MB; mb++) mma(c[mb][j], a, xb[p][mb][0], xb[p][mb][1]);
            }
        }
    };
    const int count = live ? i1 - i0 : 0;
    // the weights do not depend on the previous kernel (had_in): fetch them before waiting on it
#pragma unroll
    for (int p = 0; p < P; p++) load_w(p, p < count);
    pdl_wait();
    if constexpr (PRO != 0) {             // had_in_body's pass on this split's 128-column blocks
        const int chunks = (i1 - i0) >> 3;
        const int k = kt * 16;
        for (int task = threadIdx.x >> 5; task < rows * chunks; task += blockDim.x >> 5) {
            const int m = task / chunks, ch = task % chunks;
            const int o = z * rows + m;
            const int col = i0 * 16 + ch * 128 + 4 * lane;
            const half* suh = reinterpret_cast<const half*>(suh_ptrs[row_exp ? row_exp[o] : 0]);
            float v[4];
            const TX* xo_ = x + (size_t)(row_src ? row_src[o] : o) * k + col;
            if constexpr (PRO == 2)
                rotate4_act(xo_, xo_ + (size_t)act_rows * k, suh + col, v);
            else
                rotate4(xo_, suh + col, v);
            if constexpr (XD) {
                // columns k .. k + 3 of k-tile 8 ch + lane / 4, k = 4 (lane % 4): dup(k), dup(k + 1)
                // at lane t = (k % 8) / 2's words 2 (k >= 8), + 1; dup(k + 2), dup(k + 3) at t + 1's
                // (AFF: (x, 0) there, (0, x) 16 words further)
                const int kk = 4 * (lane & 3);
                uint32_t* d = xs + m * xstride + (ch * 8 + (lane >> 2)) * XW + 2 * (kk & 7) + (kk >= 8 ? 2 : 0);
                uint32_t u[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const half2 h = CB == 2 ? __halves2half2(__float2half_rn(v[q]), __ushort_as_half(0))
                                            : __float2half2_rn(v[q]);
                    u[q] = *reinterpret_cast<const uint32_t*>(&h);
                }
                *reinterpret_cast<uint2*>(d) = make_uint2(u[0], u[1]);
                *reinterpret_cast<uint2*>(d + 4) = make_uint2(u[2], u[3]);
                if constexpr (CB == 2) {      // (0, x): the halves swapped
                    *reinterpret_cast<uint2*>(d + 16) = make_uint2(u[0] << 16, u[1] << 16);
                    *reinterpret_cast<uint2*>(d + 20) = make_uint2(u[2] << 16, u[3] << 16);
                }
            } else {
                half2 h0 = __floats2half2_rn(v[0], v[1]);
                half2 h1 = __floats2half2_rn(v[2], v[3]);
                uint32_t* d = xs + m * xstride + ch * 64 + 2 * lane;   // k-tile 8 ch + lane / 4
                d[0] = *reinterpret_cast<uint32_t*>(&h0);
                d[1] = *reinterpret_cast<uint32_t*>(&h1);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int p = 0; p < P; p++) load_x(p, p < count);
    int it = 0;
    for (; it + P <= count; it += P) {
#pragma unroll
        for (int p = 0; p < P; p++) {
            step(p);                              // consume stage p, then refill it
            load_w(p, it + p + P < count);
            load_x(p, it + p + P < count);
        }
    }
#pragma unroll
    for (int p = 0; p < P - 1; p++)
        if (p < count - it) step(p);

#if HALVES && CB == 2
    if constexpr (AFF) {
        if (live) add_fragments_aff<NT>(acc, acc64, c, z * rows, valid, n, j0, g, t);
        return;
    }
#endif
    if (live) add_fragments<MB, NT>(acc, acc64, c, z * rows, valid, n, j0, g, t);
}

// ------------------------------------------------------------------ decode Ŵ (transposed store)
// 4 x 4 transpose across the lanes t = 0..3 of a quad (4 shuffles): lane t holds v[q]; after it,
// lane t holds at v[s] what lane s held at v[t].
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4], int t) {
#pragma unroll
    for (int j = 0; j < 2; j++) {            // swap the off-diagonal 2 x 2 blocks (lanes t, t ^ 2)
        const bool hi = t & 2;
        const uint32_t r = __shfl_xor_sync(0xffffffffu, hi ? v[j] : v[j + 2], 2);
        if (hi) v[j] = r; else v[j + 2] = r;
    }
#pragma unroll
    for (int j = 0; j < 4; j += 2) {         // then within each 2 x 2 block (lanes t, t ^ 1)
        const bool hi = t & 1;
        const uint32_t r = __shfl_xor_sync(0xffffffffu, hi ? v[j] : v[j + 1], 1);
        if (hi) v[j] = r; else v[j + 1] = r;
    }
}

// Store one decoded tile (i, j) of Ŵᵀ: b[0] = rows 2t, 2t+1 of column g; b[1] rows 2t+8, 2t+9;
// b[2], b[3] the same for g + 8 (§5.5). After a quad transpose lane t holds b[t] of its quad's four
// lanes, i.e. 16 contiguous bytes of one wt row: one 16-byte store a lane, each row's 32 bytes
// (a whole sector) from one instruction. (Four 4-byte stores, each sector written in two halves by
// two instructions, ran at ~1.5 TB/s: 77 µs for a 4096 x 14336 Ŵ on the H200.)
__device__ __forceinline__ void store_tile_t(uint32_t* __restrict__ wt, uint32_t (&b)[4], int i, int j, int k2,
                                             int g, int t) {
    quad_transpose(b, t);
    uint32_t* dst = wt + (size_t)(16 * j + g + 8 * (t >> 1)) * k2 + 8 * i + 4 * (t & 1);
    *reinterpret_cast<uint4*>(dst) = make_uint4(b[0], b[1], b[2], b[3]);
}

// The decode kernels' lane setup: the bit offset of lane L's first window and the NL tile words it
// loads (their indices within a tile of NW words).
__device__ __forceinline__ void lane_words(int lane, int& off, int (&widx)[NL]) {
    int word;
    lane_origin(lane, word, off);
#pragma unroll
    for (int m = 0; m < NL; m++) widx[m] = (word + m) % NW;
}

// tile u of a decode quad: (i, j) one step on from tile u - 1's
__device__ __forceinline__ void step_tile(int u, int nt, int& i, int& j) {
    if (u && ++j == nt) {
        j = 0;
        i++;
    }
}

// wt[n, k] = Ŵ[k, n] (fp16), so that y = x @ Ŵ is one cuBLAS call on wt.T. One warp per tile,
// four tiles in flight per warp (grid-stride over tile quads). ``ld``: tiles per trellis row, so
// that nt adjacent n-tiles of a wider trellis (tr pointing at the first) decode alone: the rows >
// 64 path decodes a large Ŵ in column chunks, never the whole matrix at once.
__device__ __forceinline__ void decode_body(const uint32_t* __restrict__ tr, uint32_t* __restrict__ wt, int kt, int nt,
                                            int ld) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    int off, widx[NL];
    lane_words(lane, off, widx);
    const int k2 = kt * 8;   // uint32 (half pairs) per wt row
    const long tiles = (long)kt * nt;
    const long warps = (long)gridDim.x * (blockDim.x >> 5);
    const Consts kc;
    // whole quads only: every lane of the warp takes part in the shuffles of store_tile_t
    for (long q = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); q * 4 < tiles; q += warps) {
        // the quad's tile (i, j) pairs from one division (a 64-bit one is a called subroutine, and
        // one a tile cost ~25 instructions x 8 a quad); then j steps by one, wrapping at nt. SASS
        // (sm_90a, K 3) of the quad loop ~760 -> ~470 instructions; H100 2026-12-06: 70.9 -> 70.5
        // µs at 4096 x 14336 (the time is the memory side's: ncu, 2026-12-03, L2 82 % busy)
        const int i0 = (int)(q * 4 / nt), j0 = (int)(q * 4 - (long)i0 * nt);
        uint32_t w[4][NL];
        int i = i0, j = j0;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            step_tile(u, nt, i, j);
            if (q * 4 + u < tiles) {
                const uint32_t* src = tr + ((size_t)i * ld + (size_t)j) * NW;
#pragma unroll
                for (int m = 0; m < NL; m++) w[u][m] = ldg32(src + widx[m]);
            }
        }
        i = i0, j = j0;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if (q * 4 + u >= tiles) break;   // uniform across the warp
            step_tile(u, nt, i, j);
            uint32_t b[4];
            decode_tile(kc, w[u], off, b);
            store_tile_t(wt, b, i, j, k2, g, t);
        }
    }
}

// decode_body's cooperative-load variant (exl3_decode_t_coop; nt % 4 == 0, so a quad's 4 tiles are
// 4 NW contiguous words of one tile row, 16-byte aligned). decode_body's lanes each load their NL
// words of every tile with 4-byte loads issued back to back, so the L1 misses on all of them and
// each tile's sectors go to L2 about three times (ncu, H200, 4096 x 14336: L2 82 % busy, DRAM 44 %,
// 55 µs). Here the warp loads its quad once, in 16-byte pieces (the next quad's while it decodes
// this one), and hands each lane its words through 64 * K2 bytes of shared memory a warp.
constexpr int QV = NW;                 // uint4 a quad holds (4 tiles x NW words)
constexpr int QL = (QV + 31) / 32;     // uint4 a lane loads a quad
__device__ __forceinline__ void decode_coop_body(const uint32_t* __restrict__ tr, uint32_t* __restrict__ wt, int kt,
                                                 int nt, int ld) {
    __shared__ uint4 qs[8][QV];        // a quad's words per warp (blocks of 256 threads)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    int off, widx[NL];
    lane_words(lane, off, widx);
    const int k2 = kt * 8;
    const long quads = (long)kt * nt / 4;
    const long warps = (long)gridDim.x * (blockDim.x >> 5);
    const Consts kc;
    uint4 nx[QL];
    auto load = [&](long q) {
        const long tile = q * 4;
        const uint4* src = reinterpret_cast<const uint4*>(tr + ((size_t)(tile / nt) * ld + (size_t)(tile % nt)) * NW);
#pragma unroll
        for (int p = 0; p < QL; p++)
            if (lane + 32 * p < QV) nx[p] = __ldg(src + lane + 32 * p);
    };
    const uint32_t* ws = reinterpret_cast<const uint32_t*>(qs[warp]);
    long q = (long)blockIdx.x * (blockDim.x >> 5) + warp;
    if (q < quads) load(q);
    for (; q < quads; q += warps) {
#pragma unroll
        for (int p = 0; p < QL; p++)
            if (lane + 32 * p < QV) qs[warp][lane + 32 * p] = nx[p];
        __syncwarp();
        if (q + warps < quads) load(q + warps);
        const long tile0 = q * 4;
        const int i = (int)(tile0 / nt), j0 = (int)(tile0 % nt);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            uint32_t w[NL];
#pragma unroll
            for (int m = 0; m < NL; m++) w[m] = ws[u * NW + widx[m]];
            uint32_t b[4];
            decode_tile(kc, w, off, b);
            store_tile_t(wt, b, i, j0 + u, k2, g, t);
        }
        __syncwarp();   // every lane has read this quad before the next one overwrites it
    }
}

// One natural-order Hadamard butterfly: (x, y) -> (x + y, x - y); across lanes, with lane ^ m:
// sg = -1 in the upper lane (fma(sg, v, o): the lower lane's v + o, the upper's o - v, exactly)
__device__ __forceinline__ void bfly(float& x, float& y) {
    const float a = x;
    x = a + y;
    y = a - y;
}
__device__ __forceinline__ void bfly_lanes(float& v, int m, float sg) {
    const float o = __shfl_xor_sync(0xffffffffu, v, m);
    v = fmaf(sg, v, o);
}
// wt[n, k] = fp16(W'[k, n]), W' = Ŵ · H_n / sqrt(128) ⊙ svh: the output Hadamard pass and svh
// folded into the decoded weights, so that y = xrot @ W' + bias is one cuBLAS call and no output
// pass runs (its cost grows with the rows: 56 µs at 2048 x 14336 on the H200). One warp per (k-tile
// i, 8 adjacent n-tiles = one 128-column Hadamard block): its 8 tiles' 64 values a lane in fp32;
// the column index n = 16 u + 8 h + g (u the tile, h = b index >> 1, g = lane >> 2), so the 128-
// point transform is 4 butterfly stages in registers (h, u) and 3 across lanes (g: xor 4, 8, 16).
// nt: a multiple of 8; svh: the svh of these columns (n-tile 0 of tr). fold_n is one such warp's
// part, left in f in fp32 with svh / sqrt(128) applied: f[u][q][p] [tile u][b index q][half p] is
// column 16 u + 8 (q >> 1) + g, row 2 t + 8 (q & 1) + p of k-tile i (decode_fold2 goes on from it).
// LANES false (decode_fold2): only the decode and the in-register stages, n bits 3..6, no svh.
template <bool LANES = true>
__device__ __forceinline__ void fold_n(const Consts& kc, const uint32_t* __restrict__ tr, const half* __restrict__ svh,
                                       int i, int j0, int ld, int off, const int (&widx)[NL], float (&f)[8][4][2]) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    uint32_t w[8][NL];
    const uint32_t* src = tr + ((size_t)i * ld + j0) * NW;
#pragma unroll
    for (int u = 0; u < 8; u++)
#pragma unroll
        for (int m = 0; m < NL; m++) w[u][m] = ldg32(src + u * NW + widx[m]);
#pragma unroll
    for (int u = 0; u < 8; u++) {
        uint32_t b[4];
        decode_tile(kc, w[u], off, b);
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float2 v = __half22float2(*reinterpret_cast<const half2*>(&b[q]));
            f[u][q][0] = v.x;
            f[u][q][1] = v.y;
        }
    }
    // n bit 3: b index q vs q + 2
#pragma unroll
    for (int u = 0; u < 8; u++)
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int p = 0; p < 2; p++) {
                bfly(f[u][q][p], f[u][q + 2][p]);
            }
    // n bits 4..6: tile u vs u ^ s
#pragma unroll
    for (int s = 1; s < 8; s <<= 1)
#pragma unroll
        for (int u = 0; u < 8; u++) {
            if (u & s) continue;
#pragma unroll
            for (int q = 0; q < 4; q++)
#pragma unroll
                for (int p = 0; p < 2; p++) {
                    bfly(f[u][q][p], f[u + s][q][p]);
                }
        }
    if constexpr (LANES) {
        // n bits 0..2: g, across lanes
#pragma unroll
        for (int m = 4; m < 32; m <<= 1) {
            const float sg = (lane & m) ? -1.f : 1.f;
#pragma unroll
            for (int u = 0; u < 8; u++)
#pragma unroll
                for (int q = 0; q < 4; q++)
#pragma unroll
                    for (int p = 0; p < 2; p++) {
                        bfly_lanes(f[u][q][p], m, sg);
                    }
        }
        const half* sv = svh + 16 * j0 + g;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const float s0 = __half2float(sv[16 * u]) * 0.08838834764831845f;      // column g
            const float s1 = __half2float(sv[16 * u + 8]) * 0.08838834764831845f;  // column g + 8
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float sc = q < 2 ? s0 : s1;
                f[u][q][0] *= sc;
                f[u][q][1] *= sc;
            }
        }
    }
}
__device__ __forceinline__ void decode_fold_body(const uint32_t* __restrict__ tr, uint32_t* __restrict__ wt,
                                                 const half* __restrict__ svh, int kt, int nt, int ld) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    int off, widx[NL];
    lane_words(lane, off, widx);
    const int k2 = kt * 8;
    const int nb = nt >> 3;
    const long items = (long)kt * nb;
    const long warps = (long)gridDim.x * (blockDim.x >> 5);
    const Consts kc;
    for (long it = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
        const int i = (int)(it / nb), j0 = (int)(it % nb) * 8;
        float f[8][4][2];
        fold_n(kc, tr, svh, i, j0, ld, off, widx, f);
#pragma unroll
        for (int u = 0; u < 8; u++) {
            uint32_t b[4];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                half2 h = __floats2half2_rn(f[u][q][0], f[u][q][1]);
                b[q] = *reinterpret_cast<uint32_t*>(&h);
            }
            store_tile_t(wt, b, i, j0 + u, k2, g, t);
        }
    }
}
#endif  // EXL3_HOST_TEST

// ------------------------------------------------------------------ Hadamard passes
// One warp per (row, 128-column block); lane holds columns 4L..4L+3. Natural-order Sylvester H128
// (§5.7) as 7 butterfly stages in fp32: 2 in registers, 5 across lanes.
#ifndef EXL3_HOST_TEST
// SIGN_FMA (the GRID passes): each butterfly as fma(v, ±1, o), the upper lane's o - v and the lower
// one's v + o exactly (the same bits), one FMA-pipe instruction a value where a select (ALU) and an
// add were two
template <bool SIGN_FMA>
__device__ __forceinline__ void fwht128(float (&v)[4]) {
    float a = v[0] + v[1], b = v[0] - v[1], c = v[2] + v[3], d = v[2] - v[3];
    v[0] = a + c; v[1] = b + d; v[2] = a - c; v[3] = b - d;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const bool up = lane & m;
        const float sgn = up ? -1.0f : 1.0f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float o = __shfl_xor_sync(0xffffffffu, v[q], m);
            v[q] = SIGN_FMA ? __fmaf_rn(v[q], sgn, o) : up ? o - v[q] : v[q] + o;
        }
    }
}

// 4 consecutive values as fp32, from fp16 or fp32 storage
__device__ __forceinline__ void load4(const half* p, float (&v)[4]) {
    const uint2 a = *reinterpret_cast<const uint2*>(p);
    const float2 f0 = __half22float2(*reinterpret_cast<const half2*>(&a.x));
    const float2 f1 = __half22float2(*reinterpret_cast<const half2*>(&a.y));
    v[0] = f0.x; v[1] = f0.y; v[2] = f1.x; v[3] = f1.y;
}
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
__device__ __forceinline__ void load4(const long long* p, float (&v)[4]) {    // fixed point (red_fixed)
    const longlong2 a = *reinterpret_cast<const longlong2*>(p), b = *reinterpret_cast<const longlong2*>(p + 2);
    v[0] = __ll2float_rn(a.x) * FIX_INV; v[1] = __ll2float_rn(a.y) * FIX_INV;
    v[2] = __ll2float_rn(b.x) * FIX_INV; v[3] = __ll2float_rn(b.y) * FIX_INV;
}
__device__ __forceinline__ void store4(half* p, const float (&v)[4]) {
    half2 o0 = __floats2half2_rn(v[0], v[1]), o1 = __floats2half2_rn(v[2], v[3]);
    uint2 ov;
    ov.x = *reinterpret_cast<uint32_t*>(&o0);
    ov.y = *reinterpret_cast<uint32_t*>(&o1);
    *reinterpret_cast<uint2*>(p) = ov;
}
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

// xrot[o, :] = fp16(H(x[src(o), :] ⊙ suh_e) / sqrt(128)); o = z * rows + m, src(o) = src_idx ?
// src_idx[z] * rows + m : o, e = exp_idx ? exp_idx[z] : 0. x is fp16 or fp32 (the runtime's
// activations), so no conversion kernel runs before it.
#include "sm90_async.cuh"   // cp.async, wgmma and barrier wrappers (mla_decode.cu's too)
#include "exl3_tiles.cuh"   // the prefill tile kernels' bodies (they use the Hadamard helpers above)
#include "exl3_wgmma.cuh"   // dense linears of 65-256 rows a slot on wgmma

// The input rotation of lane L's 4 values (x at its column, the sign vector at the same column):
// (x ⊙ suh) · H128 / sqrt(128) in fp32, had_in's arithmetic (and the gemv's own input pass's)
template <bool SIGN_FMA = false>
__device__ __forceinline__ void rotate4_vals(const half* __restrict__ suh, float (&v)[4]) {
    float sv[4];
    load4(suh, sv);
#pragma unroll
    for (int q = 0; q < 4; q++) v[q] *= sv[q];
    fwht128<SIGN_FMA>(v);
#pragma unroll
    for (int q = 0; q < 4; q++) v[q] *= 0.08838834764831845f;   // 1/sqrt(128)
}
template <typename TX, bool SIGN_FMA>
__device__ __forceinline__ void rotate4(const TX* __restrict__ x, const half* __restrict__ suh, float (&v)[4]) {
    load4(x, v);
    rotate4_vals<SIGN_FMA>(suh, v);
}

// wt[n, k] = fp16(W[k, n]) for the whole linear, W = diag(suh) · H_k · Ŵ · H_n · diag(svh) / 128 (both
// Hadamard passes and both sign vectors folded in: exl3-format.md §5.7, the reference decoder's final
// W), so that y = x @ W + bias is one cuBLAS call on the raw activations, with neither had_in (61 µs
// at 2048 x 14336 on the H100) nor had_out. One block of 8 warps per (128-row block kb of k, 128-column
// block jb of n); warp w decodes k-tile 8 kb + w. Each value goes through the shuffle / shared-memory
// unit 5 times (3 warp-shuffle stages, one store, one load; 10 in the first version, which that unit
// bounded: 118 -> 88 µs under ncu at 4096 x 14336, H100, the 2026-12-06 23:08 session): the decode's
// 64 values a lane take the six stages its registers hold (n bits 3..6 and k bits 0 and 3); shared
// memory, then each thread holds 8 contiguous rows (k bits 0..2) x k bit 6 x n bits 0, 1 (64 values):
// k bits 1, 2, 6 and n bits 0, 1 in registers, k bits 4, 5 and n bit 2 across lanes (xor 2, 8, 4).
// Its lanes are k bits 3, 4, n 2, k 5, n 3 (bits 0..4), its warp n bits 4..6, so a 16-byte store a
// lane writes 4 whole 128-byte lines of wt per instruction. Element (n, k) lives at n F2_LD + f2_k(k):
// the row's k bits in the order 0, 1, 3, 4, 2, 5, 6, with which both passes are free of bank
// conflicts (the float2 stores' half-warps and the float4 loads' quarter-warps;
// tests/test_cuda_fold2_mirror.py checks both and the result on the CPU). Rounded once. nt: a
// multiple of 8; svh: of these columns (n-tile 0 of tr); suh: the whole k.
constexpr int F2_LD = 132;   // floats a column (cuda_dense.FOLD2_SMEM = 128 x F2_LD x 4 bytes)
__host__ __device__ __forceinline__ int f2_k(int k) {
    return (k & 3) | ((k >> 1) & 12) | ((k & 4) << 2) | (k & 0x60);
}
__device__ __forceinline__ void decode_fold2_body(const uint32_t* __restrict__ tr, half* __restrict__ wt,
                                                  const half* __restrict__ suh, const half* __restrict__ svh,
                                                  int kt, int nt, int ld) {
    extern __shared__ __align__(16) float fs[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nb = nt >> 3;
    const int kb = blockIdx.x / nb, j0 = (blockIdx.x % nb) * 8;
    {
        const int g = lane >> 2, t = lane & 3;
        int off, widx[NL];
        lane_words(lane, off, widx);
        const Consts kc;
        float f[8][4][2];
        fold_n<false>(kc, tr, svh, 8 * kb + warp, j0, ld, off, widx, f);
        // f[u][q][p]: column 16 u + 8 (q >> 1) + g, k row 16 warp + 2 t + 8 (q & 1) + p; k bit 0 (p),
        // then k bit 3 (q & 1)
#pragma unroll
        for (int u = 0; u < 8; u++)
#pragma unroll
            for (int h = 0; h < 4; h += 2) {
                bfly(f[u][h][0], f[u][h][1]);
                bfly(f[u][h + 1][0], f[u][h + 1][1]);
                bfly(f[u][h][0], f[u][h + 1][0]);
                bfly(f[u][h][1], f[u][h + 1][1]);
            }
#pragma unroll
        for (int u = 0; u < 8; u++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                *reinterpret_cast<float2*>(fs + (16 * u + 8 * (q >> 1) + g) * F2_LD +
                                           f2_k(16 * warp + 2 * t + 8 * (q & 1))) = make_float2(f[u][q][0], f[u][q][1]);
    }
    __syncthreads();
    // v[a][h][e]: column nl + a, row kl + 64 h + e
    const int kl = 8 * (lane & 1) + 16 * ((lane >> 1) & 1) + 32 * ((lane >> 3) & 1);
    const int nl = 4 * ((lane >> 2) & 1) + 8 * (lane >> 4) + 16 * warp;
    float v[4][2][8];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float* src = fs + (nl + a) * F2_LD + f2_k(kl + 64 * h);
            const float4 x = *reinterpret_cast<const float4*>(src), y = *reinterpret_cast<const float4*>(src + 16);
            v[a][h][0] = x.x; v[a][h][1] = x.y; v[a][h][2] = x.z; v[a][h][3] = x.w;
            v[a][h][4] = y.x; v[a][h][5] = y.y; v[a][h][6] = y.z; v[a][h][7] = y.w;
        }
    // k bits 1, 2 (e), 6 (h); n bits 0, 1 (a)
#pragma unroll
    for (int s = 2; s < 8; s <<= 1)
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    if (e & s) continue;
                    bfly(v[a][h][e], v[a][h][e + s]);
                }
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int e = 0; e < 8; e++) bfly(v[a][0][e], v[a][1][e]);
#pragma unroll
    for (int s = 1; s < 4; s <<= 1)
#pragma unroll
        for (int a = 0; a < 4; a++) {
            if (a & s) continue;
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 8; e++) bfly(v[a][h][e], v[a + s][h][e]);
        }
    // k bit 4 (lane xor 2), n bit 2 (xor 4), k bit 5 (xor 8)
#pragma unroll
    for (int m = 2; m < 16; m <<= 1) {
        const float sg = (lane & m) ? -1.f : 1.f;
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 8; e++) bfly_lanes(v[a][h][e], m, sg);
    }
    float sv[4];
    load4(svh + 16 * j0 + nl, sv);
    // one base pointer and small int offsets from it: the 8 stores. 64-bit addresses held 24 bytes
    // past 80 registers
    const int k = kt * 16;
    half* dst = wt + (size_t)(16 * j0 + nl) * k + 128 * kb + kl;
    const half* sup = suh + 128 * kb + kl;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float su[2][4];   // rows kl + 64 h + e
        load4(sup + 64 * h, su[0]);
        load4(sup + 64 * h + 4, su[1]);
#pragma unroll
        for (int a = 0; a < 4; a++) {
            const float sc = sv[a] * (1.f / 128.f);
            uint32_t o[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                half2 r = __floats2half2_rn(v[a][h][e] * sc * su[e >> 2][e & 3],
                                            v[a][h][e + 1] * sc * su[e >> 2][(e & 3) + 1]);
                o[e >> 1] = *reinterpret_cast<uint32_t*>(&r);
            }
            *reinterpret_cast<uint4*>(dst + (a * k + 64 * h)) = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
}
// ACT: the input is silu(gate) * up of a gate+up call's output (fused_decode.silu_mul's fp32
// arithmetic, rounded to TX as its output would be), gate row at x, up row at u
__device__ __forceinline__ float as_stored(float v, const half*) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ float as_stored(float v, const float*) { return v; }
template <typename TX, bool SIGN_FMA>
__device__ __forceinline__ void rotate4_act(const TX* __restrict__ x, const TX* __restrict__ u,
                                            const half* __restrict__ suh, float (&v)[4]) {
    float b[4];
    load4(x, v);
    load4(u, b);
#pragma unroll
    for (int q = 0; q < 4; q++) v[q] = as_stored(v[q] / (1.0f + __expf(-v[q])) * b[q], x);
    rotate4_vals<SIGN_FMA>(suh, v);
}

// GRID (the default; EXL3TOOLS_HAD_GRID=0 takes the 1-D passes): block (o, j) of a 2-D grid takes row o's 128-column blocks
// 8 j .. 8 j + 7, a warp each, so an item costs no 64-bit division of a flat index and no row
// division where there are no source or expert indices; its butterflies are SIGN_FMA's. The 1-D
// passes executed ~193 instructions an item (had_out at 2048 x 14336 on the H100, ncu: issue slots
// 85 % busy, the ALU pipe the busiest at 61 %, DRAM throughput 47 %, 2026-12-06).
template <bool GRID>
__device__ __forceinline__ bool had_item(int total_rows, int blocks, int& o, int& blk) {
    if constexpr (GRID) {
        o = blockIdx.x;
        blk = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
        return blk < blocks;
    }
    const long item = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= (long)total_rows * blocks) return false;
    o = (int)(item / blocks), blk = (int)(item % blocks);
    return true;
}

template <typename TX, bool ACT = false, bool GRID = false>
__device__ __forceinline__ void had_in_body(const TX* __restrict__ x, half* __restrict__ xrot,
                                            const uint64_t* __restrict__ suh_ptrs, const int* __restrict__ src_idx,
                                            const int* __restrict__ exp_idx, int rows, int total_rows, int k,
                                            const int* __restrict__ tile_n, int tile_rows, int act_rows = 0) {
    pdl_launch_dependents();               // gemv prefetches weights meanwhile, then waits for us
    const int blocks = k >> 7;
    int o, blk;
    if (!had_item<GRID>(total_rows, blocks, o, blk)) return;
    if (tile_n && o % tile_rows >= tile_n[o / tile_rows]) return;   // a padding row (tiles_body skips it)
    int z = 0, m = o;                      // slot z's row m (GRID: divided only where indices need it)
    if (!GRID || src_idx || exp_idx) z = o / rows, m = o % rows;
    const int src = src_idx ? src_idx[z] * rows + m : o;
    const half* suh = reinterpret_cast<const half*>(suh_ptrs[exp_idx ? exp_idx[z] : 0]);
    const int col = blk * 128 + 4 * (threadIdx.x & 31);
    float v[4];
    if constexpr (ACT)
        rotate4_act<TX, GRID>(x + (size_t)src * k + col, x + ((size_t)src + act_rows) * k + col, suh + col, v);
    else
        rotate4<TX, GRID>(x + (size_t)src * k + col, suh + col, v);
    store4(xrot + (size_t)o * k + col, v);
}

// y[o, :] = H(acc[o, :]) / sqrt(128) ⊙ svh_e + bias_e, stored as TY (fp16 or the runtime's fp32);
// an fp32 or fixed-point acc (the gemv workspaces) is re-zeroed as it is read.
template <typename TA, typename TY, bool GRID = false>
__device__ __forceinline__ void had_out_body(TA* __restrict__ acc, TY* __restrict__ y,
                                             const uint64_t* __restrict__ svh_ptrs, const uint64_t* __restrict__ bias_ptrs,
                                             const int* __restrict__ exp_idx, int rows, int total_rows, int n,
                                             const int* __restrict__ tile_n, int tile_rows) {
    pdl_wait();                            // acc is complete only when gemv has finished
    const int blocks = n >> 7;
    int o, blk;
    if (!had_item<GRID>(total_rows, blocks, o, blk)) return;
    // a padding row of tiles_body's tiles: never added to acc (still zero), y left undefined
    if (tile_n && o % tile_rows >= tile_n[o / tile_rows]) return;
    const int e = exp_idx ? exp_idx[o / rows] : 0;
    const int col = blk * 128 + 4 * (threadIdx.x & 31);
    float v[4];
    load4(acc + (size_t)o * n + col, v);
    if constexpr (sizeof(TA) == 4) *reinterpret_cast<float4*>(acc + (size_t)o * n + col) = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (sizeof(TA) == 8) {
        longlong2* a = reinterpret_cast<longlong2*>(acc + (size_t)o * n + col);
        a[0] = a[1] = make_longlong2(0, 0);
    }
    fwht128<GRID>(v);
    const half* svh = reinterpret_cast<const half*>(svh_ptrs[e]);
    const half* bias = bias_ptrs ? reinterpret_cast<const half*>(bias_ptrs[e]) : nullptr;
    float sv[4], bv[4] = {0.f, 0.f, 0.f, 0.f};
    load4(svh + col, sv);
    if (bias) load4(bias + col, bv);
#pragma unroll
    for (int q = 0; q < 4; q++) v[q] = v[q] * 0.08838834764831845f * sv[q] + bv[q];
    store4(y + (size_t)o * n + col, v);
}
#endif  // EXL3_HOST_TEST

}  // namespace

// ------------------------------------------------------------------ entry points (C names)
#ifndef EXL3_HOST_TEST
#define GEMV(MROWS, NT)                                                                              \
    extern "C" __global__ void __launch_bounds__(128) exl3_gemv_m##MROWS##_t##NT(                     \
        const uint32_t* xrot, const uint64_t* trellis_ptrs, const int* slot_exp, float* acc,          \
        unsigned long long* acc64, int rows, int kt, int nt, int kps, int n_groups, int n_units,      \
        const int* tile_n) {                                                                          \
        gemv_body<MROWS, NT, 4, 0, half>(xrot, trellis_ptrs, slot_exp, acc, acc64, rows, kt, nt, kps, n_groups, n_units, \
                                nullptr, nullptr, nullptr, nullptr, nullptr, 0, tile_n);              \
    }
// GEMV_LD(MROWS, NT): the same with each expert's trellis width from ld_tab (CudaGroup's column chunks)
#define GEMV_LD(MROWS, NT)                                                                           \
    extern "C" __global__ void __launch_bounds__(128) exl3_gemv_ld_m##MROWS##_t##NT(                  \
        const uint32_t* xrot, const uint64_t* trellis_ptrs, const int* slot_exp, float* acc,          \
        unsigned long long* acc64, int rows, int kt, int nt, int kps, int n_groups, int n_units,      \
        const int* ld_tab) {                                                                          \
        gemv_body<MROWS, NT, 4, 0, half, true>(xrot, trellis_ptrs, slot_exp, acc, acc64, rows, kt, nt, kps, \
                                               n_groups, n_units, nullptr, nullptr, nullptr, nullptr, ld_tab); \
    }
// TILES(MROWS, NT, MINB, P): tiles_body with registers for MINB blocks an SM (4: 128, 3: 168), P k-tiles
// a pipeline stage (2 for the wide tiles: their accumulators leave no registers for 4)
#define TILES(MROWS, NT, MINB, P)                                                                    \
    extern "C" __global__ void __launch_bounds__(128, MINB) exl3_tiles_m##MROWS##_t##NT(              \
        const uint32_t* xrot, const uint64_t* trellis_ptrs, const int* slot_exp, float* acc,          \
        unsigned long long* acc64, int rows, int kt, int nt, int kps, int n_groups, int n_units,      \
        const int* tile_n) {                                                                          \
        tiles_body<MROWS, NT, P>(xrot, trellis_ptrs, slot_exp, acc, acc64, rows, kt, nt, kps, n_groups, n_units, \
                                 tile_n);                                                             \
    }
#else
#define GEMV(MROWS, NT)
#define GEMV_LD(MROWS, NT)
#define TILES(MROWS, NT, MINB, P)
#endif
GEMV(8, 1)
GEMV(8, 2)
GEMV(16, 1)
GEMV(16, 2)
GEMV(32, 1)
GEMV(32, 2)
GEMV(64, 1)
GEMV(64, 2)
GEMV_LD(8, 2)
GEMV_LD(16, 2)
GEMV_LD(32, 2)
GEMV_LD(64, 2)
// GEMV_PRO: the 8-row gemv with its own input pass (no had_in launch), x fp16 or fp32
#ifndef EXL3_HOST_TEST
// PRO_P, PRO_MINB: the GEMV_PRO* kernels' k-tiles in flight and blocks an SM, overridable build
// defines for tuning A/Bs (cuda_build.extra_defines, EXL3TOOLS_GEMV_DEFINES); the defaults are
// what tests/gpu and the benchmarks run
#ifndef PRO_P
#define PRO_P 4
#endif
#ifdef PRO_MINB
#define PRO_BOUNDS __launch_bounds__(128, PRO_MINB)
#else
#define PRO_BOUNDS __launch_bounds__(128)
#endif
#define GEMV_PRO(NAME, TX, LD)                                                                       \
    extern "C" __global__ void PRO_BOUNDS NAME(                                                      \
        const TX* x, const uint64_t* suh_ptrs, const int* row_src, const int* row_exp,               \
        const uint64_t* trellis_ptrs, const int* slot_exp, float* acc, int rows, int kt, int nt,     \
        int kps, int n_groups, int n_units, const int* ld_tab) {                                     \
        gemv_body<8, 2, PRO_P, 1, TX, LD>(nullptr, trellis_ptrs, slot_exp, acc, nullptr, rows, kt, nt, kps, n_groups, \
                                      n_units, x, suh_ptrs, row_src, row_exp, ld_tab);               \
    }
GEMV_PRO(exl3_gemv_pro_m8_t2_f16, half, false)
GEMV_PRO(exl3_gemv_pro_m8_t2_f32, float, false)
GEMV_PRO(exl3_gemv_pro_ld_m8_t2_f16, half, true)
GEMV_PRO(exl3_gemv_pro_ld_m8_t2_f32, float, true)
#if HALVES && CB == 2
// the same with AFF (MUL1 halves modules, rows <= AFF_ROWS: cuda_gemv.gemv_pro picks them), with
// the most blocks an SM that compile without spills (sm_90a, nvcc 13.0): 7, the pair kernel's
// (72 registers), at K 1, 1.5, 2, 3 and 4; 6 at K 2.5, 3.5, 5 and 6; 5 from K 7. At 6 blocks (77
// registers) ncu saw issue slots 52 % busy against the pair's 60 % at 7, which ate the 12 % fewer
// instructions (H100, 2026-12-05 08:18); at 7 it is 2-9 % faster at one row (10:51)
#define AFF_MINB (K2 <= 4 || K2 == 6 || K2 == 8 ? 7 : K2 <= 12 ? 6 : 5)
#ifdef PRO_MINB
#define AFF_BOUNDS __launch_bounds__(128, PRO_MINB)
#else
#define AFF_BOUNDS __launch_bounds__(128, AFF_MINB)
#endif
#define GEMV_PRO_AFF(NAME, TX, LD)                                                                   \
    extern "C" __global__ void AFF_BOUNDS NAME(                                                      \
        const TX* x, const uint64_t* suh_ptrs, const int* row_src, const int* row_exp,               \
        const uint64_t* trellis_ptrs, const int* slot_exp, float* acc, int rows, int kt, int nt,     \
        int kps, int n_groups, int n_units, const int* ld_tab) {                                     \
        gemv_body<8, 2, PRO_P, 1, TX, LD, true>(nullptr, trellis_ptrs, slot_exp, acc, nullptr, rows, kt, nt, kps, \
                                            n_groups, n_units, x, suh_ptrs, row_src, row_exp, ld_tab); \
    }
GEMV_PRO_AFF(exl3_gemv_pro_aff_m8_t2_f16, half, false)
GEMV_PRO_AFF(exl3_gemv_pro_aff_m8_t2_f32, float, false)
GEMV_PRO_AFF(exl3_gemv_pro_ld_aff_m8_t2_f16, half, true)
GEMV_PRO_AFF(exl3_gemv_pro_ld_aff_m8_t2_f32, float, true)
#endif
// GEMV_PRO_ACT: its input silu(gate) * up (a gate+up call's output, up act_rows rows below gate)
#define GEMV_PRO_ACT(NAME, TX)                                                                       \
    extern "C" __global__ void PRO_BOUNDS NAME(                                                      \
        const TX* x, const uint64_t* suh_ptrs, const int* row_src, const int* row_exp,               \
        const uint64_t* trellis_ptrs, const int* slot_exp, float* acc, int rows, int kt, int nt,     \
        int kps, int n_groups, int n_units, int act_rows) {                                          \
        gemv_body<8, 2, PRO_P, 2, TX>(nullptr, trellis_ptrs, slot_exp, acc, nullptr, rows, kt, nt, kps, n_groups, \
                                  n_units, x, suh_ptrs, row_src, row_exp, nullptr, act_rows);        \
    }
GEMV_PRO_ACT(exl3_gemv_pro_act_m8_t2_f16, half)
GEMV_PRO_ACT(exl3_gemv_pro_act_m8_t2_f32, float)
#if HALVES && CB == 2
#define GEMV_PRO_ACT_AFF(NAME, TX)                                                                   \
    extern "C" __global__ void AFF_BOUNDS NAME(                                                      \
        const TX* x, const uint64_t* suh_ptrs, const int* row_src, const int* row_exp,               \
        const uint64_t* trellis_ptrs, const int* slot_exp, float* acc, int rows, int kt, int nt,     \
        int kps, int n_groups, int n_units, int act_rows) {                                          \
        gemv_body<8, 2, PRO_P, 2, TX, false, true>(nullptr, trellis_ptrs, slot_exp, acc, nullptr, rows, kt, nt, kps, \
                                               n_groups, n_units, x, suh_ptrs, row_src, row_exp, nullptr, act_rows); \
    }
GEMV_PRO_ACT_AFF(exl3_gemv_pro_act_aff_m8_t2_f16, half)
GEMV_PRO_ACT_AFF(exl3_gemv_pro_act_aff_m8_t2_f32, float)
#endif
#endif
TILES(32, 2, 4, 4)
TILES(64, 2, 3, 4)
TILES(128, 1, 3, 4)
// dense linears of 65-128 rows (EXL3TOOLS_DENSE_TILES): the weight decoded once per 128 rows; 241
// registers, no spills (sm_90a). (A 256-row variant, one n-tile a warp, measured slower than decode
// + cuBLAS everywhere on the H200, 2026-12-03: docs/gpu.md.)
TILES(128, 2, 2, 2)
// WG(NAME, MROWS, NT, WGS, MINB, P): wg_body (wgmma, WGS warpgroups a block, NT n-tiles a warp), P
// k-tiles a chunk (P - 1 MMAs in flight behind the newest, weights loaded P k-tiles ahead; 3 x P x
// MROWS x 32 B of shared memory). On the H200 (2026-12-03, docs/gpu.md): one warpgroup a block of
// one n-tile a warp was 2-5x slower than decode + cuBLAS, bound by reading the activations once per
// 64 columns; two n-tiles a warp halved that, two warpgroups a block took another 5-40 %, P 4 did
// not help. The two wg2 kernels are the fastest measured (cuda_exl3.WG_KERNELS); still slower than
// decode + cuBLAS from 256 rows and than exl3_tiles_m128_t2 at 128 (8 warps an SM decode too
// slowly beside the accumulators' registers). wg4: 16 warps an SM, for the bench.
#ifndef EXL3_HOST_TEST
#define WG(NAME, MROWS, NT, WGS, MINB, P)                                                            \
    extern "C" __global__ void __launch_bounds__(128 * WGS, MINB) NAME(                               \
        const uint32_t* xrot, const uint64_t* trellis_ptrs, const int* slot_exp, float* acc,          \
        unsigned long long* acc64, int rows, int kt, int nt, int kps, int n_groups, int n_units,      \
        const int* tile_n) {                                                                          \
        wg_body<MROWS, NT, P, WGS>(xrot, trellis_ptrs, slot_exp, acc, acc64, rows, kt, nt, kps, n_groups, n_units, \
                                   tile_n);                                                           \
    }
WG(exl3_wg2_m128_t2, 128, 2, 2, 1, 2)     // 256 columns a block
WG(exl3_wg2_m256_t1, 256, 1, 2, 1, 2)     // 128 columns a block, 256 rows: one decode for them all
WG(exl3_wg4_m128_t1, 128, 1, 4, 1, 2)     // 256 columns a block, 16 warps an SM (128 registers)
// WS3(NAME, WD): ws3_body, the warp-specialized kernel (dynamic shared memory: cuda_launch.kernel_smem),
// for the bench; WD 0 (ws3) holds the next chunk's weights in registers, ws4 a ring of WS4_WD in
// shared memory (written after the 16:47 session's last call)
#define WS3(NAME, WD)                                                                                \
    extern "C" __global__ void __launch_bounds__(1024, 1) NAME(                                       \
        const uint32_t* xrot, const uint64_t* trellis_ptrs, const int* slot_exp, float* acc,          \
        unsigned long long* acc64, int rows, int kt, int nt, int kps, int n_groups, int n_units,      \
        const int* tile_n) {                                                                          \
        ws3_body<2, 4, WD>(xrot, trellis_ptrs, slot_exp, acc, acc64, rows, kt, nt, kps, n_groups, n_units, tile_n); \
    }
WS3(exl3_ws3_m128_t2, 0)
WS3(exl3_ws4_m128_t2, WS4_WD)
// WGA(NAME, MROWS): wga_body, every warp decoding and every warpgroup multiplying (dynamic shared
// memory: cuda_launch.kernel_smem); xmap: xrot's tensor map (cuda_gemv.gemv: boxes of MROWS x 64)
#define WGA(NAME, MROWS)                                                                             \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME(                                        \
        const uint32_t* xrot, const uint64_t* trellis_ptrs, const int* slot_exp, float* acc,          \
        unsigned long long* acc64, int rows, int kt, int nt, int kps, int n_groups, int n_units,      \
        const int* tile_n, const __grid_constant__ CUtensorMap xmap) {                                \
        wga_body<MROWS>(xrot, trellis_ptrs, slot_exp, acc, acc64, rows, kt, nt, kps, n_groups, n_units, tile_n, \
                        xmap);                                                                        \
    }
WGA(exl3_wga_m256_t2, 256)
// WGR(NAME, MROWS, SK): wgr_body, two warpgroups and a producer warp (dynamic shared memory:
// cuda_launch.kernel_smem); SK: stream-K, a 1-D grid that shares all slots' work (slots: their count)
#define WGR(NAME, MROWS, SK)                                                                         \
    extern "C" __global__ void __launch_bounds__(288, 1) NAME(                                        \
        const uint32_t* xrot, const uint64_t* trellis_ptrs, const int* slot_exp, float* acc,          \
        unsigned long long* acc64, int rows, int kt, int nt, int kps, int n_groups, int n_units,      \
        const int* tile_n, const __grid_constant__ CUtensorMap xmap, int slots) {                     \
        wgr_body<MROWS, SK>(trellis_ptrs, slot_exp, acc, acc64, rows, kt, nt, kps, n_groups, n_units, tile_n, xmap, \
                            slots);                                                                   \
    }
WGR(exl3_wgr_m256_t2, 256, false)
WGR(exl3_wgr_sk_m256_t2, 256, true)
// WGR_OUT(NAME, THREADS, AS, RG, MROWS, OUT): wgr_body with the fused output pass, y in fp16 (OUT 1)
// or fp32 (2); flags and scratch (cuda_workspace.wgr_buffers) where kps < kt: a tile's splits added in
// the kernel (wgr_fixup). RG: a producer warpgroup that gives its registers to the consumers
// (setmaxnreg), AS A operands in flight (384 threads)
#define WGR_OUT(NAME, THREADS, AS, RG, MROWS, OUT)                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                    \
        const uint32_t* xrot, const uint64_t* trellis_ptrs, const int* slot_exp, float* acc,          \
        unsigned long long* acc64, int rows, int kt, int nt, int kps, int n_groups, int n_units,      \
        const int* tile_n, const __grid_constant__ CUtensorMap xmap, int slots, void* y,              \
        const uint64_t* svh_ptrs, const uint64_t* bias_ptrs, int* flags, float* scratch) {            \
        wgr_body<MROWS, false, OUT, AS, RG>(trellis_ptrs, slot_exp, acc, acc64, rows, kt, nt, kps, n_groups, n_units, \
                                            tile_n, xmap, slots, y, svh_ptrs, bias_ptrs, flags, scratch); \
    }
WGR_OUT(exl3_wgr_out_m256_t2_f16, 288, WGR_AS, false, 256, 1)
WGR_OUT(exl3_wgr_out_m256_t2_f32, 288, WGR_AS, false, 256, 2)
WGR_OUT(exl3_wgr_rg_out_m256_t2_f16, 384, 4, true, 256, 1)
WGR_OUT(exl3_wgr_rg_out_m256_t2_f32, 384, 4, true, 256, 2)
// 128-row slots (m64n128k16; MoE prefill tiles: bench and tests only, not yet run on a GPU)
WGR_OUT(exl3_wgr_rg_out_m128_t2_f16, 384, 4, true, 128, 1)
WGR_OUT(exl3_wgr_rg_out_m128_t2_f32, 384, 4, true, 128, 2)
#endif
// TILES_OUT(MROWS, MINB, SUFFIX, OUT): tiles_body with the fused output pass, y in fp16 or fp32
#ifndef EXL3_HOST_TEST
#define TILES_OUT(MROWS, MINB, SUFFIX, OUT)                                                          \
    extern "C" __global__ void __launch_bounds__(128, MINB) exl3_tiles_out_m##MROWS##_t2_##SUFFIX(     \
        const uint32_t* xrot, const uint64_t* trellis_ptrs, const int* slot_exp, float* acc, int rows, \
        int kt, int nt, int kps, int n_groups, int n_units, const int* tile_n, void* y,               \
        const uint64_t* svh_ptrs, const uint64_t* bias_ptrs) {                                        \
        tiles_body<MROWS, 2, 4, OUT>(xrot, trellis_ptrs, slot_exp, acc, nullptr, rows, kt, nt, kps, n_groups, n_units, \
                                     tile_n, y, svh_ptrs, bias_ptrs);                                 \
    }
TILES_OUT(64, 3, f16, 1)
TILES_OUT(64, 3, f32, 2)
#endif

#ifndef EXL3_HOST_TEST
extern "C" __global__ void __launch_bounds__(256, 5) exl3_decode_t(const uint32_t* tr, uint32_t* wt, int kt, int nt,
                                                                 int ld) {
    decode_body(tr, wt, kt, nt, ld);
}
extern "C" __global__ void __launch_bounds__(256) exl3_decode_t_coop(const uint32_t* tr, uint32_t* wt, int kt,
                                                                      int nt, int ld) {
    decode_coop_body(tr, wt, kt, nt, ld);
}
extern "C" __global__ void __launch_bounds__(256) exl3_decode_fold(const uint32_t* tr, uint32_t* wt, const half* svh,
                                                                    int kt, int nt, int ld) {
    decode_fold_body(tr, wt, svh, kt, nt, ld);
}
// three blocks an SM (their shared memory's limit too): 80 registers, none spilled
extern "C" __global__ void __launch_bounds__(256, 3) exl3_decode_fold2(const uint32_t* tr, half* wt, const half* suh,
                                                                       const half* svh, int kt, int nt, int ld) {
    decode_fold2_body(tr, wt, suh, svh, kt, nt, ld);
}

// GRID: the 2-D grid kernels (_grid names: cuda_gemv.had_in / had_out's default; EXL3TOOLS_HAD_GRID=0: the 1-D ones)
#define HAD_IN(NAME, TX, GRID)                                                                           \
    extern "C" __global__ void __launch_bounds__(256) NAME(const TX* x, half* xrot, const uint64_t* suh_ptrs,      \
                                                          const int* src_idx, const int* exp_idx, int rows,       \
                                                          int total_rows, int k, const int* tile_n, int tile_rows) { \
        had_in_body<TX, false, GRID>(x, xrot, suh_ptrs, src_idx, exp_idx, rows, total_rows, k, tile_n, tile_rows); \
    }
HAD_IN(exl3_had_in_f16, half, false)
HAD_IN(exl3_had_in_f32, float, false)
HAD_IN(exl3_had_in_f16_grid, half, true)
HAD_IN(exl3_had_in_f32_grid, float, true)
// HAD_IN_ACT: the input silu(gate) * up, up act_rows rows below gate (rotate4_act)
#define HAD_IN_ACT(NAME, TX, GRID)                                                                       \
    extern "C" __global__ void __launch_bounds__(256) NAME(const TX* x, half* xrot, const uint64_t* suh_ptrs,      \
                                                          const int* src_idx, const int* exp_idx, int rows,       \
                                                          int total_rows, int k, const int* tile_n, int tile_rows, \
                                                          int act_rows) {                                         \
        had_in_body<TX, true, GRID>(x, xrot, suh_ptrs, src_idx, exp_idx, rows, total_rows, k, tile_n, tile_rows, \
                                    act_rows);                                                               \
    }
HAD_IN_ACT(exl3_had_in_act_f16, half, false)
HAD_IN_ACT(exl3_had_in_act_f32, float, false)
HAD_IN_ACT(exl3_had_in_act_f16_grid, half, true)
HAD_IN_ACT(exl3_had_in_act_f32_grid, float, true)

#define HAD_OUT(NAME, TA, TY, GRID)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) NAME(TA* acc, TY* y, const uint64_t* svh_ptrs,              \
                                                          const uint64_t* bias_ptrs, const int* exp_idx, int rows, \
                                                          int total_rows, int n, const int* tile_n, int tile_rows) { \
        had_out_body<TA, TY, GRID>(acc, y, svh_ptrs, bias_ptrs, exp_idx, rows, total_rows, n, tile_n, tile_rows); \
    }
HAD_OUT(exl3_had_out_f32_f16, float, half, false)
HAD_OUT(exl3_had_out_f32_f16_grid, float, half, true)
HAD_OUT(exl3_had_out_f32_f32, float, float, false)
HAD_OUT(exl3_had_out_f32_f32_grid, float, float, true)
HAD_OUT(exl3_had_out_f16_f16, half, half, false)
HAD_OUT(exl3_had_out_f16_f16_grid, half, half, true)
HAD_OUT(exl3_had_out_f16_f32, half, float, false)
HAD_OUT(exl3_had_out_f16_f32_grid, half, float, true)
HAD_OUT(exl3_had_out_i64_f16, long long, half, false)
HAD_OUT(exl3_had_out_i64_f16_grid, long long, half, true)
HAD_OUT(exl3_had_out_i64_f32, long long, float, false)
HAD_OUT(exl3_had_out_i64_f32_grid, long long, float, true)
#endif

#ifdef EXL3_HOST_TEST
// Host check of the bit logic (nvcc -DEXL3_HOST_TEST -x cu ... && ./a.out): every lane's 8 states
// against the definition (§5.3) on random tiles. Exit status 0 = all equal.
#include <cstdio>
#include <cstdlib>
static uint32_t ring_bit(const uint32_t* u, int p) { return (u[p >> 5] >> (31 - (p & 31))) & 1u; }
int main() {
    uint32_t tile[NW];
    srand(1234 + K2);
    int bad = 0;
    for (int rep = 0; rep < 200; rep++) {
        for (int m = 0; m < NW; m++) tile[m] = ((uint32_t)rand() << 16) ^ (uint32_t)rand();
        for (int lane = 0; lane < 32; lane++) {
            int word, off;
            lane_origin(lane, word, off);
            uint32_t w[NL], s[8];
            for (int m = 0; m < NL; m++) w[m] = tile[(word + m) % NW];
            lane_states(w, off, s);
            for (int e = 0; e < 8; e++) {
                const int step = 8 * lane + e;
                const int S = ((step + 1) * K2) >> 1;
                uint32_t want = 0;
                for (int q = 0; q < 16; q++) want = (want << 1) | ring_bit(tile, ((S - 16 + q) % RING + RING) % RING);
                if (want != s[e] && bad++ < 5) printf("K2=%d lane %d e %d: got %04x want %04x\n", K2, lane, e, s[e], want);
            }
        }
    }
    printf("K2=%d NL=%d: %s\n", K2, NL, bad ? "MISMATCH" : "ok");
    return bad != 0;
}
#endif
