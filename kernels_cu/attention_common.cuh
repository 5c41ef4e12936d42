// Shared by the attention kernels (attention_fwd.cu, attention_bwd.cu): compile-time knobs,
// mma.sync TF32 products on shared-memory tiles, the tile loader and the softmax helpers.
//
// Matrix products use mma.sync m16n8k8 TF32 with fp32 accumulation. ATTN_SPLIT3 = 1 gives the
// fp32 mode: each operand x = big + small (big = x truncated to TF32, small = the remainder; see
// split_tf32()), and a·b is big·big + big·small + small·big, which restores about fp32 accuracy.
// ATTN_HALF = 1 (the tf32 and fp16 modes) keeps the operands in shared memory as fp16 instead,
// each tile scaled by a power of two (operand scales, below), and multiplies with mma.sync
// m16n8k16 on ldmatrix fragments: the same 11-bit significands as TF32, half the products and
// a fifth of the shared-memory load instructions.
// A block of ATTN_THREADS threads works on ATTN_BLOCK_Q query rows; each warp owns 16 rows (the
// resident kernel with ATTN_KEY_SPLIT = 2: each 16 rows are owned by two warps, one per half of
// the keys).
// ATTN_UNROLL_K (default 16, full) is the unrolling of the k loops of the warp products.

#include "grid_dependency.cuh"
#include "half.cuh"

#ifndef ATTN_BLOCK_Q
#define ATTN_BLOCK_Q 64
#endif
#ifndef ATTN_BLOCK_KV
#define ATTN_BLOCK_KV 32
#endif
#ifndef ATTN_HEAD_DIM
#define ATTN_HEAD_DIM 64
#endif
#ifndef ATTN_SPLIT3
#define ATTN_SPLIT3 0
#endif
#ifndef ATTN_UNROLL_K
#define ATTN_UNROLL_K 16
#endif
#ifndef ATTN_HALF
#define ATTN_HALF 0
#endif
#ifndef ATTN_KEY_SPLIT
#define ATTN_KEY_SPLIT 1
#endif
// ATTN_WGMMA = 1 (sm_90a, fp16 operands, the resident kernel with 64-row tiles): the products are
// warpgroup MMAs (wgmma) on operand tiles stored as 8×8 core matrices (operand_offset).
#ifndef ATTN_WGMMA
#define ATTN_WGMMA 0
#endif
static_assert(!ATTN_WGMMA || (ATTN_HALF && ATTN_BLOCK_Q == 64 && ATTN_KEY_SPLIT == 1 && ATTN_HEAD_DIM == 64),
              "wgmma: fp16 operands, one warpgroup of 64 query rows, head_dim 64");
static_assert(!(ATTN_HALF && ATTN_SPLIT3), "the fp16 operands and the 3xTF32 split are two builds");

#define ATTN_THREADS (ATTN_BLOCK_Q / 16 * 32 * ATTN_KEY_SPLIT)
constexpr int kUnrollK = ATTN_UNROLL_K;
// Row strides in shared memory, in operands. fp32: stride ≡ 8 (mod 32) makes the [row t][col g]
// fragment reads of a warp (load_b, load_a_trans) hit 32 different banks; the [row g][col t]
// reads (load_a, load_b_trans) are then 2-way conflicts (rows g and g + 4 share banks). No stride
// serves both orders. fp16: rows of an odd number of 16-byte units, so the eight 16-byte rows
// that ldmatrix reads at once fall in distinct banks.
#if ATTN_WGMMA
#define LD_HD ATTN_HEAD_DIM  // core matrices: no padding (the strides are wgmma's descriptors')
#else
#define LD_HD (ATTN_HEAD_DIM + 8)
#endif
#define LD_KV (ATTN_BLOCK_KV + 8)

static_assert(ATTN_BLOCK_Q % 16 == 0, "a warp owns 16 query rows");
static_assert(ATTN_BLOCK_KV % 16 == 0, "key/value tiles are whole 16-row mma tiles");
static_assert(ATTN_HEAD_DIM % 16 == 0, "head_dim must be a multiple of 16");

namespace {

#if ATTN_HALF
typedef unsigned short operand_t;  // fp16 bits
#else
typedef float operand_t;
#endif

// −∞ without <cmath> (NVRTC has no toolkit headers by default).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ unsigned tf32_bits(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#if ATTN_HALF
__device__ __forceinline__ void mma_f16(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The four 8×8 blocks of the fp16 matrix M[row0, +16) × [col0, +16) as ldmatrix.x4 fragments
// (TRANS: each block transposed), in the order (rows 0–7, cols 0–7), (8–15, 0–7), (0–7, 8–15),
// (8–15, 8–15) with ROWS_FIRST, else (0–7, 0–7), (0–7, 8–15), (8–15, 0–7), (8–15, 8–15).
// Lane l gives the address of one 16-byte row: lanes 8i..8i+7 the rows of block i.
template <bool ROWS_FIRST, bool TRANS>
__device__ __forceinline__ void ldsm_x4(unsigned r[4], const operand_t* m, int ld, int row0, int col0, int lane) {
    const int row = ROWS_FIRST ? lane & 15 : (lane & 7) + (lane >> 4) * 8;
    const int col = ROWS_FIRST ? (lane >> 4) * 8 : (lane >> 3 & 1) * 8;
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(m + (row0 + row) * ld + col0 + col));
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}
#endif

// x = big + small, exactly: big = x with the 13 low mantissa bits cleared (a TF32 value) and
// small = x − big (exact in fp32, |small| < 2^-10·|x|). small goes to the tensor cores as it is:
// they read at least TF32's 10 mantissa bits of it (the H200 truncates the rest), so what the
// split loses is below 2^-10·|small| < 2^-20·|x|, plus the dropped small·small term, below
// 2^-20·|a·b|. Two instructions an element, where rounding both parts to nearest took two cvt.rna
// (four instructions each on sm_90) and a subtraction. Both truncations shrink magnitudes, so
// over a sum of same-sign products the loss leans one way (a CPU model of 64-term dot products:
// mean relative error −1.7e-7 against ~0 when rounded); rounding big instead (add 0x1000 before
// the mask) measured 1.1–1.4× slower on the H200 (2x256x77 31.5 → 42.2 µs, 2x256x211 73.0 → 82.0,
// attention alone) for attention errors of 0.8–1.5e-6 instead of 1.7–1.9e-6, both far below what
// the fp32 mode's GEMMs leave (1.7e-5). Inf and NaN give a NaN small, hence a NaN product.
__device__ __forceinline__ void split_tf32(float x, unsigned& big, unsigned& small) {
    big = __float_as_uint(x) & 0xffffe000u;
    small = __float_as_uint(x - __uint_as_float(big));
}

// c += a·b on fp32 fragments: one TF32 product, or, for the error-compensated split (split_tf32),
// big·big into c and the two correction terms into c_lo. The tensor cores truncate the
// accumulator when they add, so the corrections get an accumulator of their own, of their own
// (small) magnitude; fold() adds it in once the products are done. Without the split c_lo is
// unused.
__device__ __forceinline__ void mma(float c[4], float c_lo[4], const float a[4], const float b[2]) {
    unsigned ab[4], bb[2];
#if ATTN_SPLIT3
    unsigned as[4], bs[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) split_tf32(a[i], ab[i], as[i]);
#pragma unroll
    for (int i = 0; i < 2; ++i) split_tf32(b[i], bb[i], bs[i]);
    mma_tf32(c_lo, as, bb);
    mma_tf32(c_lo, ab, bs);
#else
    // Already TF32: to_operand() rounded them when they were written to shared memory.
#pragma unroll
    for (int i = 0; i < 4; ++i) ab[i] = __float_as_uint(a[i]);
#pragma unroll
    for (int i = 0; i < 2; ++i) bb[i] = __float_as_uint(b[i]);
#endif
    mma_tf32(c, ab, bb);
}

// Every operand goes through shared memory; it is rounded to TF32 once there, not at each of
// its uses (a cvt per fragment element per mma cost more issue slots than the mma itself).
// The split mode keeps fp32 in shared memory and splits in mma().
__device__ __forceinline__ float to_operand(float x) {
#if ATTN_SPLIT3
    return x;
#else
    return __uint_as_float(tf32_bits(x));
#endif
}

// Operand scales (ATTN_HALF). fp16 keeps full precision only in [2^-14, 65504], so each tile
// written to shared memory as operands is stored as half(x·s), s = 2^k putting the block's
// largest finite |x| in [2^13, 2^14): nothing overflows, and elements down to 2^-28 of the largest
// keep 11 significant bits. A product is divided by its operands' scales (exact: powers of two).
// A product summed over several tiles (dK, dV over query tiles; O, dQ over key tiles) is kept at
// the scale of the latest tile, multiplied by new / old when that changes (RunScale). Inf and NaN
// are left out of the maxima and stored as they are, so they still reach the results.
// P (in [0, 1]) is stored at the fixed scale P_SCALE, dS at a scale from a bound (ds_bound_scale).
// In the fp32 builds every scale is 1.
constexpr float kNoScale = 8.50705917e37f;  // 2^126, the largest scale pow2_scale() gives
#if ATTN_HALF
constexpr float P_SCALE = 16384.f;
#else
constexpr float P_SCALE = 1.f;
#endif

// 2^(13 − E), E the exponent of amax (≥ 0, finite) raised to at least -113: amax·s < 2^14, s ≤ 2^126.
__device__ __forceinline__ float pow2_scale(float amax) { return pow2(13 - max(exponent_of(amax), -113)); }

// The larger of m and a warp's accumulator tile's largest finite |element|.
template <int NT>
__device__ __forceinline__ float max_finite_abs(float m, const float c[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) m = fmaxf(m, finite_abs(c[n][i]));
    return m;
}

// The block's scale in two halves around a __syncthreads: each warp leaves the max of its
// threads' m in red[warp]; after the barrier every thread reads the scale of the block's max.
// A red slot is written again only after a later barrier that follows every read. In the fp32
// builds nothing is published and the scale is 1.
__device__ __forceinline__ void publish_max(float* red, float m) {
#if ATTN_HALF
#pragma unroll
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
#endif
}
// The largest of the values the block's warps published in red (after the barrier).
__device__ __forceinline__ float block_max(const float* red) {
    float m = red[0];
#pragma unroll
    for (int w = 1; w < ATTN_THREADS / 32; ++w) m = fmaxf(m, red[w]);
    return m;
}
__device__ __forceinline__ float read_scale(const float* red) {
#if ATTN_HALF
    return pow2_scale(block_max(red));
#else
    return 1.f;
#endif
}

// c[·][col] += bias[col] for a warp's 16-row accumulator tile (C layout: columns n·8 + 2t, + 1).
template <int NT>
__device__ __forceinline__ void add_to_columns(float c[NT][4], const float* bias, int t) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const float2 b = *reinterpret_cast<const float2*>(bias + n * 8 + 2 * t);
        c[n][0] += b.x, c[n][1] += b.y;
        c[n][2] += b.x, c[n][3] += b.y;
    }
}

// The scale s to store the tiles of a run at, whose products are summed: update() takes the next
// tile's own scale and sets s to it, but to at most 2^30 times the least own scale of the run (so
// the sum, kept at the latest tile's scale, stays below ~2^100: a tile 2^30 smaller than the
// largest before it loses bits instead), and ratio = new s / old s, what the sum so far must be
// multiplied by. A single tile is a run of one.
struct RunScale {
    float s = kNoScale, least = kNoScale, ratio = 1.f;
    __device__ __forceinline__ void update(float own) {
        least = fminf(least, own);
        const float next = fminf(own, least * 1073741824.f);
        ratio = next / s;
        s = next;
    }
};

// Two (store_pair) or four (store_quad) consecutive operands x·s, aligned to their size.
__device__ __forceinline__ void store_pair(operand_t* p, float x0, float x1, float s) {
#if ATTN_HALF
    *reinterpret_cast<unsigned*>(p) = pack_half2(x0 * s, x1 * s);
#else
    *reinterpret_cast<float2*>(p) = make_float2(to_operand(x0 * s), to_operand(x1 * s));
#endif
}
__device__ __forceinline__ void store_quad(operand_t* p, float4 x, float s) {
#if ATTN_HALF
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_half2(x.x * s, x.y * s), pack_half2(x.z * s, x.w * s));
#else
    *reinterpret_cast<float4*>(p) =
        make_float4(to_operand(x.x * s), to_operand(x.y * s), to_operand(x.z * s), to_operand(x.w * s));
#endif
}

template <int NT>
__device__ __forceinline__ void fold(float c[NT][4], const float c_lo[NT][4]) {
#if ATTN_SPLIT3
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[n][i] += c_lo[n][i];
#endif
}

// Split mode: acc += hi + lo in fp32 (round to nearest). A running sum over many key tiles kept
// in a tensor-core accumulator would be truncated at every step, a bias that the row sums of
// dWo and dWq would pile up; so each tile's product gets fresh accumulators.
template <int NT>
__device__ __forceinline__ void add_tile(float acc[NT][4], const float hi[NT][4], const float lo[NT][4]) {
#if ATTN_SPLIT3
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] += hi[n][i] + lo[n][i];
#endif
}

template <int NT>
__device__ __forceinline__ void zero(float c[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
}

// Fragment loads from shared memory (g = lane / 4, t = lane % 4, PTX m16n8k8 .tf32 layouts).
// A(r, k) = M[r][k]
__device__ __forceinline__ void load_a(float a[4], const float* m, int ld, int r0, int k0, int g, int t) {
    a[0] = m[(r0 + g) * ld + k0 + t];
    a[1] = m[(r0 + g + 8) * ld + k0 + t];
    a[2] = m[(r0 + g) * ld + k0 + t + 4];
    a[3] = m[(r0 + g + 8) * ld + k0 + t + 4];
}
// A(r, k) = M[k][r]
__device__ __forceinline__ void load_a_trans(float a[4], const float* m, int ld, int r0, int k0, int g, int t) {
    a[0] = m[(k0 + t) * ld + r0 + g];
    a[1] = m[(k0 + t) * ld + r0 + g + 8];
    a[2] = m[(k0 + t + 4) * ld + r0 + g];
    a[3] = m[(k0 + t + 4) * ld + r0 + g + 8];
}
// B(k, n) = M[k][n]
__device__ __forceinline__ void load_b(float b[2], const float* m, int ld, int k0, int n0, int g, int t) {
    b[0] = m[(k0 + t) * ld + n0 + g];
    b[1] = m[(k0 + t + 4) * ld + n0 + g];
}
// B(k, n) = M[n][k]
__device__ __forceinline__ void load_b_trans(float b[2], const float* m, int ld, int k0, int n0, int g, int t) {
    b[0] = m[(n0 + g) * ld + k0 + t];
    b[1] = m[(n0 + g) * ld + k0 + t + 4];
}

// Element (row, col) of an operand tile with row stride ld (its columns, with ATTN_WGMMA): row-major, or
// with ATTN_WGMMA in 8×8 core matrices of 128 contiguous bytes, core matrix (row / 8, col / 8) at
// element (row / 8)·ld·8 + (col / 8)·64 (wgmma's no-swizzle layout; scripts/wgmma_probe.py).
__device__ __forceinline__ int operand_offset(int row, int col, int ld) {
#if ATTN_WGMMA
    return (row >> 3) * ld * 8 + (col >> 3) * 64 + (row & 7) * 8 + (col & 7);
#else
    return row * ld + col;
#endif
}

#if ATTN_WGMMA
// ---- warpgroup MMA (sm_90a) ----
// wgmma.mma_async m64nNk16 (fp16 operands, fp32 accumulators) with both operands in shared memory,
// described by start address, LBO (bytes between core matrices adjacent along K) and SBO (along M
// or N), no swizzle. The accumulators of warp w are rows 16w … 16w + 15 in mma.sync's m16n8 C
// layout (c[n][0..3]: rows g, g + 8, columns 8n + 2t, + 1), so the code around the products is
// the mma.sync kernel's. Checked on the H200 for every operand order (scripts/wgmma_probe.py).
__device__ __forceinline__ unsigned long long wg_desc(const operand_t* tile, unsigned byte_offset, unsigned lbo,
                                                      unsigned sbo) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(tile)) + byte_offset;
    return ((address & 0x3ffff) >> 4) | (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(sbo >> 4) << 32);
}

#define WG_REGS_8(a, b, c, d, e, f, g, h) "%" #a ", %" #b ", %" #c ", %" #d ", %" #e ", %" #f ", %" #g ", %" #h
#define WG_REGS_16 WG_REGS_8(0, 1, 2, 3, 4, 5, 6, 7) ", " WG_REGS_8(8, 9, 10, 11, 12, 13, 14, 15)
#define WG_REGS_32 WG_REGS_16 ", " WG_REGS_8(16, 17, 18, 19, 20, 21, 22, 23) ", " WG_REGS_8(24, 25, 26, 27, 28, 29, 30, 31)
#define WG_OUT_2(n) "+f"(c[n][0]), "+f"(c[n][1]), "+f"(c[n][2]), "+f"(c[n][3]), "+f"(c[n + 1][0]), "+f"(c[n + 1][1]), \
                    "+f"(c[n + 1][2]), "+f"(c[n + 1][3])

// c (+)= A·B^T for one k step; N/2 accumulators a thread. TA, TB: the operand's tile holds it
// transposed (K along its rows).
template <int N> struct Wgmma;
#define WGMMA_N(N, REGS, A, B, P, TA, TB, ...)                                                                    \
    template <> struct Wgmma<N> {                                                                                 \
        template <int TRANS_A, int TRANS_B>                                                                       \
        __device__ __forceinline__ static void mma(float (&c)[N / 8][4], unsigned long long da,                   \
                                                   unsigned long long db, int accumulate) {                       \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                          \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" REGS "}, %" #A ", %" #B      \
                         ", p, 1, 1, %" #TA ", %" #TB ";\n}\n"                                                    \
                         : __VA_ARGS__                                                                            \
                         : "l"(da), "l"(db), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));                       \
        }                                                                                                         \
    };
WGMMA_N(16, WG_REGS_8(0, 1, 2, 3, 4, 5, 6, 7), 8, 9, 10, 11, 12, WG_OUT_2(0))
WGMMA_N(32, WG_REGS_16, 16, 17, 18, 19, 20, WG_OUT_2(0), WG_OUT_2(2))
WGMMA_N(48, WG_REGS_16 ", " WG_REGS_8(16, 17, 18, 19, 20, 21, 22, 23), 24, 25, 26, 27, 28, WG_OUT_2(0), WG_OUT_2(2),
        WG_OUT_2(4))
WGMMA_N(64, WG_REGS_32, 32, 33, 34, 35, 36, WG_OUT_2(0), WG_OUT_2(2), WG_OUT_2(4), WG_OUT_2(6))
WGMMA_N(80, WG_REGS_32 ", " WG_REGS_8(32, 33, 34, 35, 36, 37, 38, 39), 40, 41, 42, 43, 44, WG_OUT_2(0), WG_OUT_2(2), WG_OUT_2(4), WG_OUT_2(6),
        WG_OUT_2(8))

// The accumulators' writes stay before the chain's fence and their reads after its wait: the asm
// statements around the chain name no registers, so without this the compiler may move them.
template <int N>
__device__ __forceinline__ void pin_accumulators(float (&c)[N / 8][4]) {
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(c[n][i])::"memory");
}

// c (+)= A·B^T for the block's 64 rows (one warpgroup: every thread calls it), K = 16·k_steps:
// A (64 × K) from tile a with a_cols columns ([64][K], or with TA [K][64]), B (N × K) from tile b
// ([N][K], or with TB [K][N]). The tiles' stores must be behind fence_operands() and a barrier.
// wg_issue starts the chain (one commit group); c is ready, and the tiles read, after wg_wait.
template <int N, int TA, int TB>
__device__ __forceinline__ void wg_issue(float (&c)[N / 8][4], const operand_t* a, int a_cols, const operand_t* b,
                                         int b_cols, int k_steps, bool accumulate) {
    // (LBO, SBO) of a tile: K along its columns, or (transposed) along its rows; a k step is 2 LBO.
    const unsigned a_lbo = TA ? a_cols * 16 : 128, a_sbo = TA ? 128 : a_cols * 16;
    const unsigned b_lbo = TB ? b_cols * 16 : 128, b_sbo = TB ? 128 : b_cols * 16;
    pin_accumulators<N>(c);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < k_steps; ++k)
        Wgmma<N>::template mma<TA, TB>(c, wg_desc(a, k * 2 * a_lbo, a_lbo, a_sbo),
                                       wg_desc(b, k * 2 * b_lbo, b_lbo, b_sbo), accumulate || k > 0);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// c (+)= A·B^T for the block's 64 rows, N = 64, K = 16·k_steps, with A from registers: a[k] holds
// k step k's fragment of the warp's 16 rows (mma.sync's m16k16 A layout, f16x2: what an m64nK
// accumulator tile packed in pairs gives, store_fragments), B from tile b as wg_issue's.
template <int TB, int K_STEPS>
__device__ __forceinline__ void wg_issue_rs(float (&c)[8][4], const unsigned (&a)[K_STEPS][4], const operand_t* b,
                                            int b_cols) {
    const unsigned b_lbo = TB ? b_cols * 16 : 128, b_sbo = TB ? 128 : b_cols * 16;
    pin_accumulators<64>(c);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < K_STEPS; ++k)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" WG_REGS_32 "}, {%32, %33, %34, %35}, %36, "
                     "p, 1, 1, %38;\n}\n"
                     : WG_OUT_2(0), WG_OUT_2(2), WG_OUT_2(4), WG_OUT_2(6)
                     : "r"(a[k][0]), "r"(a[k][1]), "r"(a[k][2]), "r"(a[k][3]),
                       "l"(wg_desc(b, k * 2 * b_lbo, b_lbo, b_sbo)), "r"(k), "n"(TB));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Wait for every chain issued so far; pin_accumulators on each of their accumulators after it.
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// One chain, issued and waited for.
template <int N, int TA, int TB>
__device__ __forceinline__ void wg_product(float (&c)[N / 8][4], const operand_t* a, int a_cols, const operand_t* b,
                                           int b_cols, int k_steps, bool accumulate) {
    wg_issue<N, TA, TB>(c, a, a_cols, b, b_cols, k_steps, accumulate);
    wg_wait();
    pin_accumulators<N>(c);
}

#endif

// With ATTN_WGMMA: make this thread's shared-memory stores visible to wgmma (the async proxy) before
// the barrier that follows.
__device__ __forceinline__ void fence_operands() {
#if ATTN_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Rows [row0, row0 + ROWS) of a head's ATTN_HEAD_DIM columns on their way into shared memory:
// load() reads them from global memory into registers, adding a bias (may be null), with rows at
// or past n_valid as zeros so padded rows contribute nothing, and their largest finite |x|;
// store() writes them times s as operands. Every load of a thread is issued before the first
// store: one global-memory latency per tile (two tiles loaded before either is stored share one).
// Warp w takes rows [w·ROWS/warps, (w + 1)·ROWS/warps): a query tile's 16 rows of each warp (without
// a key split) are the warp's own, which it alone reads until the tile's products over all rows.
// With ATTN_WGMMA, warp w takes columns [16w, 16w + 16) of every row instead: each store instruction
// then writes two whole core matrices (8 rows × 8 columns, 256 contiguous bytes), with no bank
// conflict (rows by warp spread a warp's stores over 8 core matrices at one offset: 8-way).
template <int ROWS>
struct TileIn {
#if ATTN_WGMMA
    static constexpr int PER_THREAD = ROWS / 8;
    static_assert(ROWS % 8 == 0 && ATTN_THREADS == 128 && ATTN_HEAD_DIM == 64, "16 columns a warp, 8 rows a pass");
    __device__ __forceinline__ static int col() { return threadIdx.x / 32 * 16 + threadIdx.x % 4 * 4; }
    __device__ __forceinline__ static int row(int j) { return j * 8 + threadIdx.x % 32 / 4; }
#else
    static constexpr int VEC_PER_ROW = ATTN_HEAD_DIM / 4, WARP_ROWS = ROWS / (ATTN_THREADS / 32);
    static constexpr int PER_THREAD = WARP_ROWS * VEC_PER_ROW / 32;
    static_assert(32 % VEC_PER_ROW == 0 && WARP_ROWS * (ATTN_THREADS / 32) == ROWS &&
                  PER_THREAD * 32 == WARP_ROWS * VEC_PER_ROW, "whole rows per warp, whole passes per row");
    __device__ __forceinline__ static int col() { return (threadIdx.x % VEC_PER_ROW) * 4; }
    __device__ __forceinline__ static int row(int j) {
        return threadIdx.x / 32 * WARP_ROWS + threadIdx.x % 32 / VEC_PER_ROW + j * (32 / VEC_PER_ROW);
    }
#endif
    float4 v[PER_THREAD];
    float amax;

    __device__ __forceinline__ void load(const float* __restrict__ src, long long ld_src, int row0, int n_valid,
                                         const float* __restrict__ bias) {
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j)
            v[j] = row0 + row(j) < n_valid
                       ? *reinterpret_cast<const float4*>(src + (long long)(row0 + row(j)) * ld_src + col())
                       : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 b = bias ? *reinterpret_cast<const float4*>(bias + col()) : make_float4(0.f, 0.f, 0.f, 0.f);
        amax = 0.f;
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j) {
            if (row0 + row(j) < n_valid) {
                v[j] = make_float4(v[j].x + b.x, v[j].y + b.y, v[j].z + b.z, v[j].w + b.w);
                amax = fmaxf(fmaxf(amax, fmaxf(finite_abs(v[j].x), finite_abs(v[j].y))),
                             fmaxf(finite_abs(v[j].z), finite_abs(v[j].w)));
            }
        }
    }

    __device__ __forceinline__ void store(operand_t* dst, float s) const {
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j) store_quad(dst + operand_offset(row(j), col(), LD_HD), v[j], s);
    }
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Start a cp.async of 16 bytes from global `from` to shared `to`; 16 zero bytes where !valid (none
// read, but `from` must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* to, const void* from, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(to));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(from), "r"(valid ? 16 : 0)
                 : "memory");
}

// Start copying rows [row0, row0 + ROWS) of a head's ATTN_HEAD_DIM columns, as they are (fp32), into
// stage ([ROWS][ATTN_HEAD_DIM]) with cp.async, rows at or past n_valid as zeros; one commit group.
// They are there after cp_async_wait_all() and a barrier; TileIn::load reads them from there.
template <int ROWS>
__device__ __forceinline__ void prefetch_tile(float* stage, const float* __restrict__ src, long long ld_src, int row0,
                                              int n_valid) {
    using T = TileIn<ROWS>;
#pragma unroll
    for (int j = 0; j < T::PER_THREAD; ++j) {
        const int row = T::row(j), col = T::col();
        const bool valid = row0 + row < n_valid;
        const float* from = valid ? src + (long long)(row0 + row) * ld_src + col : src;  // 0 bytes read if not valid
        cp_async_16(stage + row * ATTN_HEAD_DIM + col, from, valid);
    }
    cp_async_commit();
}

#if ATTN_HALF
// each(row, col) for the 16-byte pieces (8 fp16 operands of a row) of a [ROWS][ATTN_HEAD_DIM] tile
// that this thread copies (copy_half_tile) and later reads back (copied_half_amax).
template <int ROWS, typename Each>
__device__ __forceinline__ void for_each_half_piece(Each each) {
    // Piece i = threadIdx.x + j · ATTN_THREADS (the block's threads, ATTN_THREADS of them): a trip
    // count known at compile time, so no bounds check or branch per piece but in a last, partial trip.
    constexpr int PIECES = ATTN_HEAD_DIM / 8, N = ROWS * PIECES;  // PIECES: a row's
#pragma unroll
    for (int j = 0; j < (N + ATTN_THREADS - 1) / ATTN_THREADS; ++j) {
        const int i = threadIdx.x + j * ATTN_THREADS;
        if ((j + 1) * ATTN_THREADS <= N || i < N) each(i / PIECES, i % PIECES * 8);  // the first: every thread
    }
}

// Start copying rows [row0, row0 + ROWS) of a head's ATTN_HEAD_DIM columns of an fp16 tensor, as they
// are, into the operand tile dst (operand_offset's layout, row stride LD_HD) with cp.async, 16 bytes
// at a time, rows at or past n_valid as zeros; the caller commits the group. They are there after
// cp_async_wait_all() and a barrier. For operands already scaled for fp16 in global memory
// (ATTN_KV_HALF; attn_bwd_lean's Q0 and dO with ATTN_QDO_HALF): no pass through registers, no
// conversion, half the bytes of fp32.
template <int ROWS>
__device__ __forceinline__ void copy_half_tile(operand_t* dst, const unsigned short* __restrict__ src, long long ld_src,
                                               int row0, int n_valid) {
    for_each_half_piece<ROWS>([&](int row, int col) {
        const bool valid = row0 + row < n_valid;
        const unsigned short* from = valid ? src + (long long)(row0 + row) * ld_src + col : src;  // 0 bytes read if not
        cp_async_16(dst + operand_offset(row, col, LD_HD), from, valid);
    });
}

// The largest finite |x| of the pieces of tile (copy_half_tile's) that this thread copied, read
// back after its cp_async_wait_all(), which makes its own copies visible to it: no barrier. On
// the bits: a non-negative fp16 orders like its bits, and from 0x7c00 on it is Inf or NaN.
template <int ROWS>
__device__ __forceinline__ float copied_half_amax(const operand_t* tile) {
    unsigned m = 0;
    for_each_half_piece<ROWS>([&](int row, int col) {
        const uint4 piece = *reinterpret_cast<const uint4*>(tile + operand_offset(row, col, LD_HD));
        for (unsigned word : {piece.x, piece.y, piece.z, piece.w})
            for (unsigned bits : {word & 0x7fffu, word >> 16 & 0x7fffu})
                if (bits < 0x7c00u) m = max(m, bits);
    });
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(static_cast<unsigned short>(m)));
    return x;
}
#endif

// Two tiles into shared memory (TileIn), stored at the scales their runs give them (RunScale),
// the tiles' own found over one __syncthreads (publish_max); 1 in the fp32 builds, with no barrier.
// Only the first takes a bias (bq into Q; null for K): dO's tile has none, and bk, bv stay out of
// the key/value tiles (attention_bwd.cu).
template <int ROWS>
__device__ __forceinline__ void load_tiles(operand_t* dst_a, const float* src_a, const float* bias_a, float* red_a,
                                           RunScale& run_a, operand_t* dst_b, const float* src_b, float* red_b,
                                           RunScale& run_b, long long ld_src, int row0, int n_valid) {
    TileIn<ROWS> a, b;
    a.load(src_a, ld_src, row0, n_valid, bias_a);
    b.load(src_b, ld_src, row0, n_valid, nullptr);
    publish_max(red_a, a.amax);
    publish_max(red_b, b.amax);
    if (ATTN_HALF) __syncthreads();
    run_a.update(read_scale(red_a));
    run_b.update(read_scale(red_b));
    a.store(dst_a, run_a.s);
    b.store(dst_b, run_b.s);
}

// One tile, as stored by the forward kernel (fp32 builds only: no operand scale).
template <int ROWS>
__device__ __forceinline__ void load_tile(operand_t* dst, const float* __restrict__ src, long long ld_src, int row0,
                                          int n_valid, const float* __restrict__ bias) {
    static_assert(!ATTN_HALF, "fp16 operands need their scales: load_tiles");
    TileIn<ROWS> a;
    a.load(src, ld_src, row0, n_valid, bias);
    a.store(dst, 1.f);
}

// The k loop of this warp's products A·B over K: A = its 16 rows of a_s ([rows][ld_a]), B = b_s
// (row stride LD_HD) read as [K][NT·8] or, with B_TRANS, as [NT·8][K]; mma(hi[n], lo[n], …) for
// each of the NT column tiles. rows_times_t and rows_times_add give it their accumulators.
template <int NT, int K, bool B_TRANS>
__device__ __forceinline__ void rows_products(float hi[NT][4], float lo[NT][4], const operand_t* a_s, int ld_a,
                                              const operand_t* b_s, int r0, int g, int t) {
#if ATTN_HALF
    // k steps of 16; the B fragments of column tiles n and n + 1 come from one ldmatrix.x4.
    static_assert(NT % 2 == 0 && K % 16 == 0, "whole 16 × 16 operand blocks");
    const int lane = g * 4 + t;
#pragma unroll kUnrollK
    for (int k = 0; k < K; k += 16) {
        unsigned a[4];
        ldsm_x4<true, false>(a, a_s, ld_a, r0, k, lane);
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            unsigned b[4];
            if (B_TRANS)
                ldsm_x4<false, false>(b, b_s, LD_HD, n * 8, k, lane);  // B(k, n) = M[n][k]
            else
                ldsm_x4<true, true>(b, b_s, LD_HD, k, n * 8, lane);  // B(k, n) = M[k][n]
            mma_f16(hi[n], a, b);
            mma_f16(hi[n + 1], a, b + 2);
        }
    }
#else
#pragma unroll kUnrollK
    for (int k = 0; k < K; k += 8) {
        float a[4];
        load_a(a, a_s, ld_a, r0, k, g, t);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            float b[2];
            if (B_TRANS)
                load_b_trans(b, b_s, LD_HD, k, n * 8, g, t);
            else
                load_b(b, b_s, LD_HD, k, n * 8, g, t);
            mma(hi[n], lo[n], a, b);
        }
    }
#endif
}

// c = A B^T for this warp's 16 rows of A (a_s) and the first NT·8 rows of B (b_s), both
// row-major [rows][head_dim] in shared memory: S = Q K^T and dP = dO V^T (the mma.sync builds; the
// wgmma kernel issues both itself, together).
template <int NT>
__device__ __forceinline__ void rows_times_t(float c[NT][4], const operand_t* a_s, const operand_t* b_s, int r0,
                                             int g, int t) {
    float c_lo[NT][4];
    zero<NT>(c);
    zero<NT>(c_lo);
    rows_products<NT, ATTN_HEAD_DIM, true>(c, c_lo, a_s, LD_HD, b_s, r0, g, t);
    fold<NT>(c, c_lo);
}

// acc += the products that products(hi, lo) issues through mma(hi[n], lo[n], …): in TF32 they
// accumulate in place (hi is acc); the split mode gives them fresh accumulators, added to acc
// in fp32 by add_tile.
template <int NT, typename Products>
__device__ __forceinline__ void accumulate(float (&acc)[NT][4], Products products) {
    float lo[NT][4];
    zero<NT>(lo);
#if ATTN_SPLIT3
    float hi[NT][4];
    zero<NT>(hi);
#else
    float (&hi)[NT][4] = acc;
#endif
    products(hi, lo);
    add_tile<NT>(acc, hi, lo);
}

// acc += A B for this warp's 16 rows of A (p_s: P or dS, [rows][ld_p], K columns) and the first
// NT·8 columns of B (v_s or k_s: [K][head_dim]): O += P V and dQ += dS K.
template <int K, int NT = ATTN_HEAD_DIM / 8>
__device__ __forceinline__ void rows_times_add(float (&acc)[NT][4], const operand_t* p_s, int ld_p,
                                               const operand_t* b_s, int r0, int g, int t) {
#if ATTN_WGMMA  // the warpgroup's 64 rows at once (r0 = 16·warp): B's tile rows run along K
    wg_product<NT * 8, 0, 1>(acc, p_s, ld_p, b_s, ATTN_HEAD_DIM, K / 16, true);
#else
    accumulate<NT>(acc, [&](float (&hi)[NT][4], float (&lo)[NT][4]) {
        rows_products<NT, K, false>(hi, lo, p_s, ld_p, b_s, r0, g, t);
    });
#endif
}

// S for NT·8 keys from kv0, scaled to log2 units (scale_log2 includes 1 / the operand scales),
// keys past n_text masked to −inf.
template <int NT>
__device__ __forceinline__ void mask_scores(float s[NT][4], int kv0, int n_text, float scale_log2, int t) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int col = kv0 + n * 8 + 2 * t;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const bool valid = col + (i & 1) < n_text;
            s[n][i] = valid ? s[n][i] * scale_log2 : neg_inf();
        }
    }
}
template <int NT>
__device__ __forceinline__ void score_tile(float s[NT][4], const operand_t* q_s, const operand_t* k_s, int r0,
                                           int kv0, int n_text, float scale_log2, int g, int t) {
    rows_times_t<NT>(s, q_s, k_s, r0, g, t);
    mask_scores<NT>(s, kv0, n_text, scale_log2, t);
}

// Store a warp's 16-row accumulator tile (C layout) times s to shared memory, as mma operands.
template <int NT>
__device__ __forceinline__ void store_acc(operand_t* m, int ld, int r0, const float c[NT][4], float s, int g,
                                          int t) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        store_pair(m + operand_offset(r0 + g, n * 8 + 2 * t, ld), c[n][0], c[n][1], s);
        store_pair(m + operand_offset(r0 + g + 8, n * 8 + 2 * t, ld), c[n][2], c[n][3], s);
    }
}

#if ATTN_WGMMA
// store_acc's stores (fp16), and the same pairs as wg_issue_rs's A fragments: k step j (columns
// 16j … 16j + 15) holds rows g, g + 8 at columns 16j + 2t (+ 1), then at 16j + 8 + 2t (+ 1).
template <int NT>
__device__ __forceinline__ void store_fragments(operand_t* m, int ld, int r0, const float c[NT][4], float s, int g,
                                                int t, unsigned (&a)[NT / 2][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const unsigned low = pack_half2(c[n][0] * s, c[n][1] * s), high = pack_half2(c[n][2] * s, c[n][3] * s);
        a[n / 2][2 * (n % 2)] = low;
        a[n / 2][2 * (n % 2) + 1] = high;
        *reinterpret_cast<unsigned*>(m + operand_offset(r0 + g, n * 8 + 2 * t, ld)) = low;
        *reinterpret_cast<unsigned*>(m + operand_offset(r0 + g + 8, n * 8 + 2 * t, ld)) = high;
    }
}

#endif

// Multiply a warp's accumulator tile by f.
template <int NT>
__device__ __forceinline__ void scale_all(float c[NT][4], float f) {
#pragma unroll
    for (int n = 0; n < NT; ++n) c[n][0] *= f, c[n][1] *= f, c[n][2] *= f, c[n][3] *= f;
}

// The scale of a tile of dS = P ∘ (dP − D) · scale, from a bound known before dS, so that no
// block maximum (and no barrier) has to wait for it: P ≤ 1, |dP| and |D| ≤ head_dim · max|dO| ·
// max|V| (up to rounding; max|V| over every key of the row, as D sums over them all), and the
// operand scales give max|dO| < 2^14 / s_do and max|V| < 2^14 / s_v (s_v: the least of the keys'),
// so |dS| < 2^(29 + log2 head_dim) · scale / (s_do · s_v); s_ds puts that at 2^14 (2^k, k clamped to
// fp32's normal exponents). The bound is loose (by ~2^8 on random inputs with 77 keys: dP averages
// over head_dim terms, P over the keys, looser with more keys), so the tile's largest |dS| lands
// near 2^6 instead of 2^13; fp16 keeps 11 significant bits down to 2^-14, i.e. for elements within
// ~2^-20 of the largest (2^-27 with the block maximum), and below that each is off by at most
// 2^-25 / s_ds, ~2^-31 of the largest.
__host__ __device__ constexpr int log2_of(int n) { return n > 1 ? 1 + log2_of(n / 2) : 0; }
constexpr int kLog2HeadDim = log2_of(ATTN_HEAD_DIM);
static_assert(1 << kLog2HeadDim == ATTN_HEAD_DIM, "head_dim is a power of two");
__device__ __forceinline__ float ds_bound_scale(float s_do, float s_v, float scale) {
#if ATTN_HALF
    int e_scale;
    frexpf(scale, &e_scale);  // |scale| < 2^e_scale
    const int k = exponent_of(s_do) + exponent_of(s_v) - e_scale - 15 - kLog2HeadDim;
    return pow2(min(max(k, -126), 126));
#else
    return 1.f;
#endif
}

// scale_log2 / (s_q·s_k), the factor of score_tile: by the smaller scale first, so that a normal
// result does not pass below the normal range midway (tiny Q with huge K; see unscale).
__device__ __forceinline__ float score_factor(float scale_log2, float s_q, float s_k) {
    return scale_log2 / fminf(s_q, s_k) / fmaxf(s_q, s_k);
}

// Divide a product by its operands' scales s1 and s2 (powers of two) as two factors 2^-e1 and
// 2^-e2 with e1 + e2 = log2(s1·s2) and e1 ≈ e2, each within fp32's normal range, the partial
// result always between the product and the result. CuPy compiles with -ftz=true: one factor
// 1/(s1·s2) flushed to 0 for gradients of 1e-31, and 1/s1 then 1/s2 overflowed midway for 1e34.
template <int NT>
__device__ __forceinline__ void unscale(float c[NT][4], float s1, float s2) {
    const int e = exponent_of(s1) + exponent_of(s2);
    const int e1 = e / 2;  // |e| ≤ 252: both halves in [-126, 126]
    scale_all<NT>(c, pow2(-e1));
    scale_all<NT>(c, pow2(e1 - e));
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Row half h (rows g and g + 8) of a warp's scores p (log2 units, masked keys at −∞) over all the
// keys it holds: p becomes exp2(p − the row's max); returns (that max, the row's sum of the new p).
// MASKED: all of a row's keys here may be masked (a key part of the resident kernel): then the max
// is −∞ and p = 0.
template <int NT, bool MASKED>
__device__ __forceinline__ float2 exp_row(float p[NT][4], int h) {
    float mx = neg_inf();
#pragma unroll
    for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(p[n][2 * h], p[n][2 * h + 1]));
    mx = quad_max(mx);
    const float base = MASKED && mx == neg_inf() ? 0.f : mx;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 2 * h; i < 2 * h + 2; ++i) sum += (p[n][i] = exp2f(p[n][i] - base));
    return make_float2(mx, quad_sum(sum));
}

// One key tile of an online softmax, for row half h (rows g and g + 8) of a warp's scores s (log2
// units, keys to skip at −∞): the running max m_run takes the tile's max (finite once the row
// has seen a valid key), corr = exp2(old max − new max) is what running sums must be scaled by,
// s becomes exp2(s − max), and each(n, i) sees every new value. Returns this thread's part of
// the row's sum of the new values.
template <int NT, typename Each>
__device__ __forceinline__ float softmax_tile_row(float s[NT][4], int h, float& m_run, float& corr, Each each) {
    float mx = m_run;
#pragma unroll
    for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
    mx = quad_max(mx);
    corr = exp2f(m_run - mx);
    m_run = mx;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 2 * h; i < 2 * h + 2; ++i) {
            s[n][i] = exp2f(s[n][i] - mx);
            sum += s[n][i];
            each(n, i);
        }
    }
    return sum;
}

// Scale a warp's 16-row accumulator tile: rows g by f[0], rows g + 8 by f[1].
template <int NT>
__device__ __forceinline__ void scale_rows(float c[NT][4], const float f[2]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        c[n][0] *= f[0]; c[n][1] *= f[0];
        c[n][2] *= f[1]; c[n][3] *= f[1];
    }
}

// each(row, col, x0, x1) for this thread's pairs (columns col, col + 1) of a warp's 16 accumulator
// rows [row0, +16) (its first NT·8 columns), rows from n_rows on left out.
template <int NT, typename Each>
__device__ __forceinline__ void for_each_pair(int row0, int n_rows, const float c[NT][4], int g, int t, Each each) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + g + 8 * h;
        if (row < n_rows) {
#pragma unroll
            for (int n = 0; n < NT; ++n) each(row, n * 8 + 2 * t, c[n][2 * h], c[n][2 * h + 1]);
        }
    }
}

// Store this warp's 16-row accumulator rows [row0 + r0, +16) of a [rows][head_dim] result (its
// first NT·8 columns).
template <int NT = ATTN_HEAD_DIM / 8>
__device__ __forceinline__ void store_rows(float* dst, long long ld, int row0, int n_rows, const float c[NT][4], int g,
                                           int t) {
    for_each_pair<NT>(row0, n_rows, c, g, t, [&](int row, int col, float x0, float x1) {
        *reinterpret_cast<float2*>(dst + (long long)row * ld + col) = make_float2(x0, x1);
    });
}

// ... as columns of its transpose, [head_dim][ld] (dst already offset to the warp's first column).
template <int NT = ATTN_HEAD_DIM / 8>
__device__ __forceinline__ void store_columns(float* dst, long long ld, int row0, int n_rows, const float c[NT][4],
                                              int g, int t) {
    for_each_pair<NT>(row0, n_rows, c, g, t, [&](int row, int col, float x0, float x1) {
        dst[(long long)col * ld + row] = x0;
        dst[(long long)(col + 1) * ld + row] = x1;
    });
}

// The column sums of those 16 rows (rows from n_rows on count as 0) into dst[0, NT·8): each quad
// adds its two rows, three shuffles add the eight quads, and the first quad stores.
template <int NT = ATTN_HEAD_DIM / 8>
__device__ __forceinline__ void column_sums(float* dst, int row0, int n_rows, const float c[NT][4], int g, int t) {
    const bool low = row0 + g < n_rows, high = row0 + g + 8 < n_rows;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        float x0 = (low ? c[n][0] : 0.f) + (high ? c[n][2] : 0.f);
        float x1 = (low ? c[n][1] : 0.f) + (high ? c[n][3] : 0.f);
#pragma unroll
        for (int lanes = 4; lanes < 32; lanes *= 2) {
            x0 += __shfl_xor_sync(0xffffffffu, x0, lanes);
            x1 += __shfl_xor_sync(0xffffffffu, x1, lanes);
        }
        if (g == 0) *reinterpret_cast<float2*>(dst + n * 8 + 2 * t) = make_float2(x0, x1);
    }
}

}  // namespace
