// Fused attention backward for cross-attention with a short key/value sequence.
//
// Math, per (batch b, head h), with the projections already done by cuBLAS:
//   Q = Q0 + bq  [Nv, d]      K = K0 + bk, V = V0 + bv  [Nt, d]      dO [Nv, d]     (d = head_dim)
//   S = scale Q K^T,  P = softmax_rows(S),  O = P V
//   dP = dO V^T,  D_i = rowsum(P ∘ dP)_i (= rowsum(dO ∘ O)_i),  dS = P ∘ (dP − D) · scale
//   dQ = dS K,  dK = dS^T Q,  dV = P^T dO
// S, P and dS live only in registers and shared memory.
//
// Layouts (row-major fp32, heads side by side in the hidden dimension D = H·d):
//   q0, dout, o, dq : [B·Nv, D] (q0, dout fp16 in attn_bwd_lean's ATTN_QDO_HALF build, q0 then
//                     (Q0 + bq) · s_Q: its GEMM adds bq)
//   kv0 : [B·Nt, 2D]  (K0 in columns [0, D), V0 in [D, 2D);
//                     fp16 at one scale with ATTN_KV_HALF, below)
//   o has row stride ld_o (D); with ATTN_O_TRANSPOSED it is O^T instead: D rows of B·Nv, row
//                     stride ld_o ≥ B·Nv (the launcher rounds it up to 32 floats, for 16-byte
//                     aligned rows): the tf32 mode's dWo = dY^T O then reads both operands
//                     K-major (transpose.cu says why); with ATTN_O_HALF it is fp16, O · s_O
//                     (o_half_scale), the operand of the fp16 and fp32 modes' dWo GEMMs (fp32, the
//                     3xTF32 build: with its fp16 remainder at o + o_lo_offset, at O_LO_SCALE
//                     times O's scale, see store_o)
//   dkv_part        : [n_chunks, B·Nt, 2D] (dK | dV of each query chunk; summed by attn_sum_parts,
//                     or in the fp16 and fp32 modes by the conversion that reads them, half_scaling.cu)
//   dq with ATTN_KV_PARTS > 1: [ATTN_KV_PARTS, B·Nv, D], the parts of dQ over the parts of the keys
//                     (summed the same ways)
//   dq_t, dq_sums   : with ATTN_DQ_TRANSPOSED (the tf32 mode, where dWq = dQ^T X reads transposes):
//                     dQ^T as well, laid out as O^T (D rows, stride ld_o), and the column sums of
//                     dQ by blocks of 16 rows of a sample, [B·⌈Nv/16⌉, D], which a ones row adds up
//                     to dbq. It saves the transposed copy of dQ after the kernel (read and write of
//                     dQ, with its sums); null pointers in the other builds
//   biases          : device array of the three bias addresses bq, bk, bv ([D] each; bk unread, below;
//                     bq too in the ATTN_QDO_HALF build)
//   text_lengths    : [B] ints, the keys each sample attends to; keys past them get P = 0, so their
//                     dK and dV rows come out 0 (every row of dkv_part is still written). Their K
//                     and V rows are not read (loaded as zeros: they cannot set an operand scale or
//                     bring an Inf in); the streamed kernel skips key tiles wholly past them
//
// Grid (n_chunks · ATTN_KV_PARTS, H, B), ATTN_THREADS threads. Block (c · ATTN_KV_PARTS + part, h, b)
// owns query tiles [c·tiles_per_chunk, (c+1)·tiles_per_chunk) of ATTN_BLOCK_Q rows; each warp owns
// 16 rows. Pass 1 streams key/value tiles with an online softmax to get each row's log-sum-exp, O
// and D. Pass 2 streams them again: exact P, dP, dS; dQ accumulates in registers, the tile's dK and
// dV are finished by the block (over its query rows) and added into its own slice of dkv_part —
// plain stores, no atomics, so results are deterministic.
// ATTN_KV_PARTS > 1 (the streamed kernel, where that many times its grid fits two blocks an SM;
// launch_layout plans it only where a chunk is one query tile, though the kernel takes more): that
// many blocks share each query chunk. All run pass 1 over all keys (the row statistics need them
// all; the same products, so the same results); part 0 alone forms and writes O, and each runs
// pass 2 over its share of the key tiles (pass2_tile), writing its keys' rows of dK and dV and its
// part of dQ. With two parts a block's chain drops from 8 products a key tile to about 3 + 5/2, and
// the SMs get twice the warps.
//
// The products, the knobs (ATTN_BLOCK_Q, ATTN_BLOCK_KV, ATTN_HEAD_DIM, ATTN_SPLIT3) and the tile
// helpers are in attention_common.cuh.

#ifndef ATTN_O_TRANSPOSED
#define ATTN_O_TRANSPOSED 0
#endif
#ifndef ATTN_O_HALF
#define ATTN_O_HALF 0
#endif
#ifndef ATTN_DQ_TRANSPOSED
#define ATTN_DQ_TRANSPOSED 0
#endif
// bk and bv are never added to the key/value tiles (every build): bk shifts each row of S by a
// constant (Q·bk), which the softmax takes out, and adds rowsum(dS)·bk = 0 to dQ; bv shifts each
// row of dP by a constant (dO·bv), which D takes out of dS, and O by bv, added to O before it is
// stored (stage_value_bias, add_to_columns). Left in, they would be rounded with K0 and V0 to the
// operands' precision: where |bk| ≫ |K0| and |Q| is large, the rounding of bk swamps Q·K0 (a sample
// with text 2^-16 and video latents, dY 2^16 times the other's made tf32's dX off by 3.7e3;
// test_gpu_backward).
// ATTN_KV_HALF (the fp16 mode; the tf32 mode's streamed kernel): kv0 is fp16, [K0 | V0] · s_KV as
// its GEMM wrote it (tf32: as a conversion wrote it), one power-of-two scale for the whole tensor
// (kv_half_scale); key/value tiles are copied into the operand tiles as they are by cp.async (the
// streamed kernel: the next while the present one is used). s_KV comes from a bound, loose by ~2^11
// on the benchmark's inputs, so dS's scale does not come through s_KV: the streamed kernel takes it
// from pass 1's max|dP| (ds_observed_scale), the resident one from its bound with the block's
// observed max|V| (v_bound_scale), attn_bwd_lean from the block's max|dP| of each query tile.
#ifndef ATTN_KV_HALF
#define ATTN_KV_HALF 0
#endif

// Keys kept resident by attn_bwd_resident (0: that kernel is not compiled).
#ifndef ATTN_KEYS
#define ATTN_KEYS 0
#endif
// Blocks that share a query chunk, each with its part of the keys in pass 2 (the streamed kernel;
// see the grid above).
#ifndef ATTN_KV_PARTS
#define ATTN_KV_PARTS 1
#endif
static_assert(ATTN_KV_PARTS == 1 || (ATTN_KV_PARTS > 1 && !ATTN_KEYS), "key parts: the streamed kernel's");

// Unrolling of the k loops of the warp products. The resident kernel (ATTN_KEYS > 0) keeps dK/dV
// accumulators for all its keys: with these loops fully unrolled, the compiler hoisted the
// fragment loads of later k steps and spilled 450–600 bytes a thread (NVRTC 13, 255 registers).
// Unrolled by 2 it spills nothing (255 registers on the H200's NVRTC) and is faster than not
// unrolled (tf32 64x128x77 155 → 142 µs; fp32 unchanged). The streamed kernel is faster fully
// unrolled (331 vs 364 µs). With fp16 operands (half the k steps, ldmatrix fragments) the
// resident kernel unrolls fully without spilling, and gains ~1 µs on the suite mean.
#define ATTN_UNROLL_K (ATTN_KEYS && !ATTN_HALF ? 2 : 16)
#include "attention_common.cuh"
static_assert(!ATTN_WGMMA || ATTN_KEYS > 0, "wgmma: the resident kernel only");

static_assert(!ATTN_O_HALF || ((ATTN_HALF || ATTN_SPLIT3) && !ATTN_O_TRANSPOSED),
              "fp16 O: row-major, from the fp16-operand or the 3xTF32 build");
static_assert(!ATTN_KV_HALF || ATTN_HALF, "fp16 K0 | V0: the fp16-operand build's");
static_assert(!ATTN_DQ_TRANSPOSED || (ATTN_O_TRANSPOSED && ATTN_KV_PARTS == 1),
              "dQ^T: beside O^T (its stride), and only where dQ is whole (one key part)");
#if ATTN_KV_HALF
typedef unsigned short kv_t;  // fp16 bits
#else
typedef float kv_t;
#endif
#if ATTN_O_HALF
typedef unsigned short o_t;  // fp16 bits
#else
typedef float o_t;
#endif

namespace {

// The A^T B products (dV = P^T dO, dK = dS^T Q) over the block's ATTN_BLOCK_Q query rows, for
// KEYS keys: A is the P or dS tile ([rows][ld_p], p_s or ds_s), B the dO or Q tile. Their 16 × 8 output
// tiles are dealt to warps by columns: a warp owns head-dim columns [warp·NPW·8, +NPW·8) of every
// key tile, so at each k step its B fragments serve all KT key tiles and each A fragment its NPW
// column tiles (2.4 shared-memory fragment loads per mma instead of 6), and its KT·NPW
// accumulators are independent mma chains. Tile j of a warp is key
// tile j / NPW, column tile warp·NPW + j % NPW.
template <int KEYS>
struct TransposedTiles {
    static constexpr int WARPS = ATTN_THREADS / 32, NPW = ATTN_HEAD_DIM / 8 / WARPS, KT = KEYS / 16, N = KT * NPW;
    static_assert(ATTN_HEAD_DIM / 8 % WARPS == 0, "the column tiles must split evenly over the warps");
    static_assert(KEYS % 16 == 0, "whole 16-row key tiles");
    // Row (of the KEYS) and column of element (g + 8·half, 2t) of tile j.
    __device__ __forceinline__ static int row(int j, int g, int half) { return j / NPW * 16 + g + 8 * half; }
    __device__ __forceinline__ static int col(int j, int warp, int t) { return (warp * NPW + j % NPW) * 8 + 2 * t; }
};

template <int KEYS>
__device__ __forceinline__ void transposed_products(float (&hi)[TransposedTiles<KEYS>::N][4],
                                                    float (&lo)[TransposedTiles<KEYS>::N][4], const operand_t* p_s,
                                                    int ld_p, const operand_t* b_s, int warp, int g, int t) {
    using T = TransposedTiles<KEYS>;
#if ATTN_HALF
    // k steps of 16 query rows; A = P^T (or dS^T) and B = dO (or Q) by transposing ldmatrix, B for
    // column tiles n and n + 1 at once (with an odd NPW, the last pair's second tile is read, from
    // the next warp's columns or the row's padding, and not used).
    const int lane = g * 4 + t;
#pragma unroll kUnrollK
    for (int k = 0; k < ATTN_BLOCK_Q; k += 16) {
        unsigned b[(T::NPW + 1) / 2][4];
#pragma unroll
        for (int n = 0; n < T::NPW; n += 2) ldsm_x4<true, true>(b[n / 2], b_s, LD_HD, k, (warp * T::NPW + n) * 8, lane);
#pragma unroll
        for (int kt = 0; kt < T::KT; ++kt) {
            unsigned a[4];
            ldsm_x4<false, true>(a, p_s, ld_p, k, kt * 16, lane);  // A(key, row) = M[row][key]
#pragma unroll
            for (int n = 0; n < T::NPW; ++n) mma_f16(hi[kt * T::NPW + n], a, b[n / 2] + 2 * (n % 2));
        }
    }
#else
#pragma unroll kUnrollK
    for (int k = 0; k < ATTN_BLOCK_Q; k += 8) {
        float b[T::NPW][2];
#pragma unroll
        for (int n = 0; n < T::NPW; ++n) load_b(b[n], b_s, LD_HD, k, (warp * T::NPW + n) * 8, g, t);
#pragma unroll
        for (int kt = 0; kt < T::KT; ++kt) {
            float a[4];
            load_a_trans(a, p_s, ld_p, kt * 16, k, g, t);
#pragma unroll
            for (int n = 0; n < T::NPW; ++n) mma(hi[kt * T::NPW + n], lo[kt * T::NPW + n], a, b[n]);
        }
    }
#endif
}

// dst[kv rows × head_dim] (+)= A^T·B / s1 / s2 for one streamed key tile (see transposed_products;
// s1, s2: the operand scales, see unscale). When accumulating, the old values are all loaded
// before the products, so their global-memory latency overlaps the arithmetic.
__device__ __forceinline__ void block_transposed_product(float* dst, long long ld_dst, int kv0, int n_text,
                                                         bool accumulate, const operand_t* p_s,
                                                         const operand_t* b_s, float s1, float s2, int warp, int g,
                                                         int t) {
    using T = TransposedTiles<ATTN_BLOCK_KV>;
    // Element (row g + 8·half, column 2t) of this warp's tile j in dst; null past the last key.
    auto at = [&](int j, int half) -> float2* {
        const int row = kv0 + T::row(j, g, half);
        return row < n_text ? reinterpret_cast<float2*>(dst + (long long)row * ld_dst + T::col(j, warp, t)) : nullptr;
    };
    float2 old[T::N][2];
#pragma unroll
    for (int j = 0; j < T::N; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float2* p = at(j, half);
            old[j][half] = accumulate && p ? *p : make_float2(0.f, 0.f);
        }
    float c[T::N][4], c_lo[T::N][4];
    zero<T::N>(c);
    zero<T::N>(c_lo);
    transposed_products<ATTN_BLOCK_KV>(c, c_lo, p_s, LD_KV, b_s, warp, g, t);
    fold<T::N>(c, c_lo);
    unscale<T::N>(c, s1, s2);
#pragma unroll
    for (int j = 0; j < T::N; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            if (float2* p = at(j, half))
                *p = make_float2(old[j][half].x + c[j][2 * half], old[j][half].y + c[j][2 * half + 1]);
}

// dS = P ∘ (dP − D) · scale for a warp's 16 rows (D of rows g and g + 8 in d_row), in place of dP.
// Its operand scale comes from a bound (ds_bound_scale) or an observed maximum of |dP|
// (ds_observed_scale), not from its own maximum.
template <int NT>
__device__ __forceinline__ void score_grads(float dp[NT][4], const float p[NT][4], const float d_row[2],
                                            float scale) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) dp[n][i] = p[n][i] * (dp[n][i] - d_row[i / 2]) * scale;
}

// dS's scale in the ATTN_KV_HALF build, from the dP of pass 1 (the same products as pass 2's):
// |dS| = P·|dP − D|·scale ≤ 2·max|dP|·scale, as P ≤ 1 and |D| ≤ max|dP| (P's rows sum to 1); the
// block's max of |dP| is in red (publish_max at the end of pass 1, a barrier before this read).
// ds_bound_scale's bound through max|V| would be as loose as s_KV's (~2^11 on the benchmark's
// inputs, more where padded text rows raise max|T|), pushing dS's elements into fp16's subnormals.
__device__ __forceinline__ float ds_observed_scale(const float* red, float scale) {
    return pow2_scale(2.f * scale * block_max(red));
}

// The resident kernel's s_v for ds_bound_scale in the ATTN_KV_HALF build: s_KV times the scale
// that would put the block's largest |V · s_KV| (red, published before a barrier) in [2^13, 2^14)
// (read_scale), so max|V| < 2^14 / that, the bound's premise, as tight as with per-block scales;
// exponent arithmetic, clamped to fp32's normal range (V all zero: any scale serves, dP is 0).
__device__ __forceinline__ float v_bound_scale(const float* red, float s_kv) {
    return pow2(min(max(exponent_of(s_kv) + exponent_of(read_scale(red)), -126), 126));
}

// The head's bv into shared memory (bv_s, ATTN_HEAD_DIM floats) once a block, for
// add_to_columns after the block's next barrier (not a global load before each tile's O stores):
// a column a thread, read (value_bias_column) and stored (stage_value_bias), apart where the
// read should be issued before other loads.
__device__ __forceinline__ float value_bias_column(const float* __restrict__ bv) {
    static_assert(ATTN_HEAD_DIM <= ATTN_THREADS, "a column a thread");
    return threadIdx.x < ATTN_HEAD_DIM ? bv[threadIdx.x] : 0.f;
}
__device__ __forceinline__ void stage_value_bias(float* bv_s, float bv) {
    if (threadIdx.x < ATTN_HEAD_DIM) bv_s[threadIdx.x] = bv;
}

// Store this warp's rows of dS (at scale s_ds) in ds_s and run dv_product (dV += P^T dO, which reads
// every row of P) on the right side of the barriers. fp16 builds: dS has a buffer of its own, so one
// barrier publishes P and dS together and the products dV, dK, dQ follow back to back. fp32 builds:
// dS takes P's place (the resident kernel's fp32 tiles leave no room for it at two blocks an SM), so
// dV runs first, between two barriers.
template <int NT, int LD, typename DvProduct>
__device__ __forceinline__ void store_ds(operand_t* ds_s, const float ds[NT][4], float s_ds, int r0, int g, int t,
                                         DvProduct dv_product) {
    if (!ATTN_HALF) {
        __syncthreads();  // all rows of P are in shared memory
        dv_product();
        __syncthreads();  // every warp is done reading P
    }
    store_acc<NT>(ds_s, LD, r0, ds, s_ds, g, t);
    fence_operands();
    __syncthreads();  // all rows of dS (and of P) are in shared memory
    if (ATTN_HALF) dv_product();
}

// The first key tile of pass 2 in key part ``part`` (ATTN_KV_PARTS: kv_tiles). A part's chain is
// about 2 products a key tile in pass 1 (S, dP) and 5 a tile of its own in pass 2; part 0 also
// forms O in pass 1 (one more a tile), so it takes s0 ≈ kv_tiles·(6 − P) / (5P) tiles (rounded;
// none from P = 6 on) and the other parts share the rest evenly. The count is rough (perf-notes
// v58: 3 + 5 of 8 tiles ran slower than 4 + 4), and an even split measured no better overall.
__device__ __forceinline__ int pass2_tile(int part, int kv_tiles) {
    constexpr int P = ATTN_KV_PARTS;
    if (P == 1) return part * kv_tiles;
    const int s0 = max(0, (2 * kv_tiles * (6 - P) + 5 * P) / (10 * P));
    return part == 0 ? 0 : s0 + (kv_tiles - s0) * (part - 1) / (P - 1);
}

// The operands of block (chunk · ATTN_KV_PARTS + part, head, batch): column offsets of its head,
// row offsets of its batch, its own slice of the dK/dV partials and its part of dQ. In: Q0's and
// dO's type (fp32, or fp16 bits in attn_bwd_lean).
template <typename In>
struct HeadSlices {
    const In *q, *dout;
    const kv_t *k, *v;
    o_t* o;
    float *dq, *dk, *dv;
    float *dq_t, *dq_sums;  // ATTN_DQ_TRANSPOSED
};

template <typename In>
__device__ __forceinline__ HeadSlices<In> head_slices(const In* q0, const kv_t* kv0, const In* dout, o_t* o, float* dq,
                                                      float* dkv_part, int n_video, int n_text, int hidden, int ld_o,
                                                      float* dq_t, float* dq_sums) {
    const int chunk = blockIdx.x / ATTN_KV_PARTS, part = blockIdx.x % ATTN_KV_PARTS;
    const int head = blockIdx.y, batch = blockIdx.z;
    const long long ld_kv = 2LL * hidden, col = head * ATTN_HEAD_DIM;
    const long long video = (long long)batch * n_video * hidden + col;
    HeadSlices<In> h;
    h.q = q0 + video;
    h.dout = dout + video;
    h.o = ATTN_O_TRANSPOSED ? o + col * ld_o + (long long)batch * n_video : o + video;
    h.dq = dq + part * (long long)gridDim.z * n_video * hidden + video;
    h.k = kv0 + (long long)batch * n_text * ld_kv + col;
    h.v = h.k + hidden;
    h.dk = dkv_part + ((long long)chunk * gridDim.z * n_text + (long long)batch * n_text) * ld_kv + col;
    h.dv = h.dk + hidden;
    h.dq_t = ATTN_DQ_TRANSPOSED ? dq_t + col * ld_o + (long long)batch * n_video : nullptr;
    h.dq_sums = ATTN_DQ_TRANSPOSED ? dq_sums + (long long)batch * ((n_video + 15) / 16) * hidden + col : nullptr;
    return h;
}

// This warp's 16 rows of dQ (its first NT·8 columns, dq_t and dq_sums already offset to them):
// rows of dq, and with ATTN_DQ_TRANSPOSED columns of dQ^T and the rows' column sums, one row of
// dq_sums for each 16 rows of the sample (row0, a multiple of 16: the warp's first row).
template <int NT = ATTN_HEAD_DIM / 8>
__device__ __forceinline__ void store_dq(float* dq, float* dq_t, float* dq_sums, int ld_t, int hidden, int row0,
                                         int n_rows, const float c[NT][4], int g, int t) {
    store_rows<NT>(dq, hidden, row0, n_rows, c, g, t);
#if ATTN_DQ_TRANSPOSED
    store_columns<NT>(dq_t, ld_t, row0, n_rows, c, g, t);
    if (row0 < n_rows) column_sums<NT>(dq_sums + (long long)(row0 / 16) * hidden, row0, n_rows, c, g, t);
#endif
}

// The fp32 mode's O remainder, O · s_O − fp16(O · s_O), is stored times 2^11. s_O comes from a
// loose bound (o_half_scale): O · s_O peaks near 2^2 on benchmark-like inputs, 2^-e lower where
// padded text rows or Wk raise the bound 2^e. A remainder is at most 2^-11 of its element, so
// unscaled it is an fp16 subnormal (bits lost) for elements under 2^-3: every element of O from
// e ≈ 5 on (fp32's dWo error at e = 12: 6.1e-5 unscaled, 1.3e-6 scaled). The conversions'
// remainders are not scaled: their scale comes from the tensor's own maximum. Scaled, a remainder
// is still at most its element, under 2^14: no overflow. dWo's product of it takes alpha_o[1] =
// alpha_o[0] / 2^11 (publish_o_scale), which flush-to-zero makes 0 below 2^-115: dY ~2^-100 below
// its usual size, where the fp32 mode's other alphas flush too (README).
constexpr float O_LO_SCALE = 2048.f;

// This warp's 16 rows of O (its first NT·8 columns): rows of o, or columns of O^T with
// ATTN_O_TRANSPOSED (row stride ld either way), or rows of fp16 O · s_o with ATTN_O_HALF (and with
// ATTN_SPLIT3, the fp32 mode, their remainders times O_LO_SCALE at o + lo_offset);
// n_rows = Nv, o already offset to the (batch, head) and to the warp's first column.
template <int NT = ATTN_HEAD_DIM / 8>
__device__ __forceinline__ void store_o(o_t* o, int ld, int row0, int n_rows, const float c[NT][4], int g, int t,
                                        float s_o, long long lo_offset) {
#if ATTN_O_HALF
    // A quad's pieces of a row in column block n are 16 bytes, half a 32-byte sector: stored as
    // they are, they cost the fp16 64x128x77 kernel 2.4 µs more than whole sectors (Session 15's
    // A/B, 107.6 → 105.2 µs). So two shuffles give lane t the 8-byte slot t of blocks n and n + 1
    // together, a whole sector per quad: pieces 2t, 2t + 1 of block n for t < 2, else pieces
    // 2t − 4, 2t − 3 of block n + 1. Lane t reads `first` from lane src = 0, 2, 1, 3 (t = 0…3),
    // `second` from src ^ 1.
    static_assert(NT % 2 == 0, "fp16 O: column blocks in pairs");
    const int src = ((t & 1) << 1) | (t >> 1);
    auto store_sector = [&](o_t* dst, bool in_range, float a0, float a1, float b0, float b1) {
        const unsigned a = pack_half2(a0, a1), b = pack_half2(b0, b1);
        const unsigned first = __shfl_sync(0xffffffffu, t & 1 ? b : a, src, 4);
        const unsigned second = __shfl_sync(0xffffffffu, t & 1 ? a : b, src ^ 1, 4);
        if (in_range) *reinterpret_cast<uint2*>(dst) = t < 2 ? make_uint2(first, second) : make_uint2(second, first);
    };
#pragma unroll
    for (int n = 0; n < NT; n += 2) {  // n outer: the mma.sync resident build spilled 4 bytes with h outer
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + g + 8 * h;
            o_t* dst = o + (long long)row * ld + n * 8 + 4 * t;
            const float a0 = c[n][2 * h] * s_o, a1 = c[n][2 * h + 1] * s_o;
            const float b0 = c[n + 1][2 * h] * s_o, b1 = c[n + 1][2 * h + 1] * s_o;
            store_sector(dst, row < n_rows, a0, a1, b0, b1);
            if (ATTN_SPLIT3)
                store_sector(dst + lo_offset, row < n_rows, remainder_of_half(a0) * O_LO_SCALE,
                             remainder_of_half(a1) * O_LO_SCALE, remainder_of_half(b0) * O_LO_SCALE,
                             remainder_of_half(b1) * O_LO_SCALE);
        }
    }
#elif ATTN_O_TRANSPOSED
    store_columns<NT>(o, ld, row0, n_rows, c, g, t);
#else
    store_rows<NT>(o, ld, row0, n_rows, c, g, t);
#endif
}

// s_O, the scale of the fp16 O (ATTN_O_HALF), a power of two that all blocks must share, fixed
// before any O is known, from a bound: rows of P sum to 1, so |O| ≤ max|V| ≤ hidden · max|T| ·
// max|Wv| + max|bv| (V = T Wv^T + bv), and the fp16 copies' scales bound max|T| ≤ 2^15 · inv_t,
// max|Wv| ≤ 2^15 · inv_w and max|bv| ≤ 2^15 · inv_bv (half_scaling.cu's window). Twice that covers
// every rounding; s_O puts it under 2^14. The bound is loose (~2^12 on the benchmark's inputs, as
// O averages over the keys; more where padded T rows or Wk, which share the bound, are larger
// than what reaches O), which costs range: elements under 2^-14 / s_O are fp16 subnormals, off
// by at most 2^-25 / s_O (README: from ~2^16 more, dWo's error grows). Three scalar loads, no
// barrier: an earlier form that took max|bv| itself held each block's start by ~1 µs. 1 (and no
// load: the pointers are null) in the builds that write fp32 O.
__device__ __forceinline__ float o_half_scale(int hidden, const float* inv_t, const float* inv_w, const float* inv_bv) {
#if ATTN_O_HALF
    return pow2_scale(2.f * fmaf(static_cast<float>(hidden) * 1073741824.f * *inv_t, *inv_w, 32768.f * *inv_bv));
#else
    return 1.f;
#endif
}

// s_KV, the scale of the fp16 [K0 | V0] (ATTN_KV_HALF; product_half_scale, as attn_bwd_lean's dO from
// the copies of dY and Wo): its GEMM multiplies the copies of T and
// [Wk; Wv], each element under 2^15 in magnitude (half_scaling.cu's window), so each sum is under
// hidden · 2^30 and the GEMM's alpha, 2^-(16 + ⌈log2 hidden⌉) (backward.py), puts it under 2^14:
// s_KV = s_T · s_W · alpha. Exponent arithmetic, clamped to fp32's normal range, which it leaves
// (and K0, V0 are then misread) only where max|T| · max|Wk, Wv| is under ~2^-(116 + ⌈log2 hidden⌉)
// or over ~2^(136 − ⌈log2 hidden⌉), 2^∓126 at hidden 1024 (README: the fp16 mode's limits).
// The tf32 mode converts its fp32 [K0 | V0] instead (half_scaling.cu, at the scale of its own max) and
// passes inv_kv, 1 / s_KV, a power of two (null in the fp16 mode).
__device__ __forceinline__ float product_half_scale(int hidden, const float* inv_a, const float* inv_b) {
    const int log2_hidden = 32 - __clz(hidden - 1);
    return pow2(product_scale_exponent(-16 - log2_hidden, *inv_a, *inv_b));
}
__device__ __forceinline__ float kv_half_scale(int hidden, const float* inv_t, const float* inv_w, const float* inv_kv) {
    return inv_kv ? pow2(-exponent_of(*inv_kv)) : product_half_scale(hidden, inv_t, inv_w);
}

#if ATTN_KEYS > 0
// The resident kernels' K and V, all NK key rows (rows at or past n_keys as zeros), into their
// operand tiles; returns their scales (s_K, s_V). ATTN_KV_HALF: copied as they are by cp.async at
// s_KV, the group committed by the caller, or with V_MAX (attn_bwd_resident's bound on |dS|) here,
// waited for, and V's largest |element| published to red_v. Else from fp32 at their own scales
// (load_tiles, with red_k and red_v its block-maximum slots).
template <int NK, bool V_MAX, typename In>
__device__ __forceinline__ float2 load_keys_values(operand_t* k_s, operand_t* v_s, const HeadSlices<In>& hs, int n_keys,
                                                   int hidden, const float* inv_t, const float* inv_w,
                                                   const float* inv_kv, float* red_k, float* red_v) {
    const long long ld_kv = 2LL * hidden;
#if ATTN_KV_HALF
    copy_half_tile<NK>(k_s, hs.k, ld_kv, 0, n_keys);
    copy_half_tile<NK>(v_s, hs.v, ld_kv, 0, n_keys);
    if (V_MAX) {
        cp_async_commit();
        cp_async_wait_all();
        publish_max(red_v, copied_half_amax<NK>(v_s));
    }
    const float s_kv = kv_half_scale(hidden, inv_t, inv_w, inv_kv);
    return make_float2(s_kv, s_kv);
#else
    RunScale k_scale, v_scale;
    load_tiles<NK>(k_s, hs.k, nullptr, red_k, k_scale, v_s, hs.v, red_v, v_scale, ld_kv, 0, n_keys);
    return make_float2(k_scale.s, v_scale.s);
#endif
}
#endif

// Block (0, 0, 0) leaves 1 / s_O in inv_o (the scale of O's slot, for the alphas the second
// conversion sets) and dWo's alpha, inv_dy / s_O, in alpha_o[0]: so dWo = dY^T O can run as soon
// as this kernel ends, beside that conversion. The same product as the alpha table's (the same
// bits). The fp32 mode's also takes alpha_o[1] = alpha_o[0] / O_LO_SCALE, for dY's copy times O's remainder.
__device__ __forceinline__ void publish_o_scale(int hidden, const float* inv_t, const float* inv_w,
                                                const float* inv_bv, const float* inv_dy, float* inv_o,
                                                float* alpha_o) {
    if (ATTN_O_HALF && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        const float inv = 1.f / o_half_scale(hidden, inv_t, inv_w, inv_bv);
        *inv_o = inv;
        alpha_o[0] = *inv_dy * inv;
        if (ATTN_SPLIT3) alpha_o[1] = alpha_o[0] / O_LO_SCALE;
    }
}

}  // namespace

// One program per build: the streamed kernel, or with ATTN_KEYS > 0 the resident one (compiling
// both took NVRTC twice as long, and the streamed kernel at the resident build's block size spilled).
#if !ATTN_KEYS
// Three blocks per SM (the shared-memory limit) need ≤ 168 registers; the split mode's extra
// accumulators do not fit that, and it runs two. With head_dim 128 two blocks fit the shared
// memory (2 × 112 KiB) and the registers (2 × 128 threads × 255); so do 64-key tiles (the
// launcher's streamed_block_kv), whose score tiles take twice the registers.
#if ATTN_SPLIT3 || ATTN_HEAD_DIM > 64 || ATTN_BLOCK_KV > 32
#define ATTN_MIN_BLOCKS 2
#else
#define ATTN_MIN_BLOCKS 3
#endif

extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_MIN_BLOCKS)
attn_bwd(const float* __restrict__ q0, const kv_t* __restrict__ kv0, const float* const* __restrict__ biases,
         const float* __restrict__ dout, o_t* __restrict__ o, float* __restrict__ dq,
         float* __restrict__ dkv_part, const int* __restrict__ text_lengths, int n_video, int n_text, int hidden,
         int ld_o, int tiles_per_chunk, float scale, const float* __restrict__ inv_t, const float* __restrict__ inv_w,
         const float* __restrict__ inv_bv, const float* __restrict__ inv_dy, float* __restrict__ inv_o,
         float* __restrict__ alpha_o, long long o_lo_offset, const float* __restrict__ inv_kv,
         float* __restrict__ dq_t, float* __restrict__ dq_sums) {
    wait_for_inputs();
    constexpr int NT_KV = ATTN_BLOCK_KV / 8, NT_HD = ATTN_HEAD_DIM / 8;
    extern __shared__ float4 smem4[];
    operand_t* q_s = reinterpret_cast<operand_t*>(smem4);  // [ATTN_BLOCK_Q][LD_HD]
    operand_t* do_s = q_s + ATTN_BLOCK_Q * LD_HD;           // [ATTN_BLOCK_Q][LD_HD]
    constexpr int KV_TILE = ATTN_BLOCK_KV * LD_HD, KV_BUFFERS = 1 + ATTN_KV_HALF;
    operand_t* const k_tiles = do_s + ATTN_BLOCK_Q * LD_HD;  // [KV_BUFFERS][ATTN_BLOCK_KV][LD_HD]
    operand_t* const v_tiles = k_tiles + KV_BUFFERS * KV_TILE;  // [KV_BUFFERS][ATTN_BLOCK_KV][LD_HD]
    operand_t* p_s = v_tiles + KV_BUFFERS * KV_TILE;         // [ATTN_BLOCK_Q][LD_KV]: P
    operand_t* ds_s = ATTN_HALF ? p_s + ATTN_BLOCK_Q * LD_KV : p_s;  // [ATTN_BLOCK_Q][LD_KV]: dS (see store_ds)
    operand_t *k_s = k_tiles, *v_s = v_tiles;  // the key/value tile in use (ATTN_KV_HALF: one of two buffers)
    __shared__ float red[4][ATTN_THREADS / 32];  // block maxima: Q, dO, K, V (ATTN_KV_HALF: red[2] max|dP|)
    __shared__ __align__(8) float bv_s[ATTN_HEAD_DIM];  // bv (stage_value_bias)

    // The caller's bias arrays move from call to call (a replayed graph cannot bake them in):
    // their addresses come from the plan's pointer table, in the order bq, bk, bv.
    const int col = blockIdx.y * ATTN_HEAD_DIM;
    const float* bq = biases[0] + col;
    stage_value_bias(bv_s, value_bias_column(biases[2] + col));  // read after pass 1's barriers
    const auto hs = head_slices(q0, kv0, dout, o, dq, dkv_part, n_video, n_text, hidden, ld_o, dq_t, dq_sums);
    publish_o_scale(hidden, inv_t, inv_w, inv_bv, inv_dy, inv_o, alpha_o);
    const int n_keys = text_lengths[blockIdx.z];  // keys this sample attends to (padding: 1 ≤ n_keys ≤ n_text)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int r0 = warp * 16;
    const float scale_log2 = scale * 1.4426950408889634f;
    const long long ld_kv = 2LL * hidden;

    const int n_q_tiles = (n_video + ATTN_BLOCK_Q - 1) / ATTN_BLOCK_Q;
    const int part = blockIdx.x % ATTN_KV_PARTS;  // of the keys, in pass 2
    const int tile_begin = blockIdx.x / ATTN_KV_PARTS * tiles_per_chunk;
    const int tile_end = min(tile_begin + tiles_per_chunk, n_q_tiles);

    // Key tiles wholly past n_keys (padding) add nothing: they are skipped, and their rows of this
    // chunk's dK and dV are written as zeros here, once (by part 0).
    const int kv_end = min(n_text, (n_keys + ATTN_BLOCK_KV - 1) / ATTN_BLOCK_KV * ATTN_BLOCK_KV);
    // Pass 2's keys [kv2_begin, kv2_end): this part's share of the key tiles. A part can have none.
    const int kv_tiles = (kv_end + ATTN_BLOCK_KV - 1) / ATTN_BLOCK_KV;
    const int kv2_begin = pass2_tile(part, kv_tiles) * ATTN_BLOCK_KV;
    const int kv2_end = min(kv_end, pass2_tile(part + 1, kv_tiles) * ATTN_BLOCK_KV);
    for (int i = threadIdx.x; part == 0 && i < (n_text - kv_end) * (ATTN_HEAD_DIM / 2); i += ATTN_THREADS) {
        const long long at = (long long)(kv_end + i / (ATTN_HEAD_DIM / 2)) * ld_kv + (i % (ATTN_HEAD_DIM / 2)) * 2;
        *reinterpret_cast<float2*>(hs.dk + at) = make_float2(0.f, 0.f);
        *reinterpret_cast<float2*>(hs.dv + at) = make_float2(0.f, 0.f);
    }

#if ATTN_KV_HALF
    // Key/value tile kv0 is copied by cp.async into buffer kv_buffer (prefetch_kv) one call of
    // load_kv ahead, which waits for it, points k_s and v_s at it and starts copying the tile the
    // next call takes, next_kv0 (none if negative), into the other buffer: one barrier a tile, and
    // the copy overlaps a whole tile's products.
    const float s_kv = kv_half_scale(hidden, inv_t, inv_w, inv_kv);
    int kv_buffer = 0;
    auto prefetch_kv = [&](int kv0) {
        copy_half_tile<ATTN_BLOCK_KV>(k_tiles + kv_buffer * KV_TILE, hs.k, ld_kv, kv0, n_keys);
        copy_half_tile<ATTN_BLOCK_KV>(v_tiles + kv_buffer * KV_TILE, hs.v, ld_kv, kv0, n_keys);
        cp_async_commit();
    };
    auto load_kv = [&](int, int next_kv0, RunScale& k_scale, RunScale& v_scale) {
        cp_async_wait_all();
        __syncthreads();  // the tile is complete; the previous tile's readers of the other buffer are done
        k_s = k_tiles + kv_buffer * KV_TILE;
        v_s = v_tiles + kv_buffer * KV_TILE;
        kv_buffer ^= 1;
        if (next_kv0 >= 0) prefetch_kv(next_kv0);
        k_scale.update(s_kv);
        v_scale.update(s_kv);
    };
#else
    // fp16 build: the next key/value tile, staged as fp32 ([ATTN_BLOCK_KV][head_dim] each)
    float* stage_k = reinterpret_cast<float*>(ds_s + ATTN_BLOCK_Q * LD_KV);
    float* stage_v = stage_k + ATTN_BLOCK_KV * ATTN_HEAD_DIM;
    // Key/value tile kv0 into k_s and v_s at the runs' scales. The fp16 build takes it from the
    // staging (fp32), where the previous call (or the start) copied it with cp.async, and starts
    // copying the tile the next call takes, next_kv0 (none if negative): the tiles' global-memory
    // latency overlaps a tile's products.
    auto prefetch_kv = [&](int kv0) {
        prefetch_tile<ATTN_BLOCK_KV>(stage_k, hs.k, ld_kv, kv0, n_keys);
        prefetch_tile<ATTN_BLOCK_KV>(stage_v, hs.v, ld_kv, kv0, n_keys);
    };
    auto load_kv = [&](int kv0, int next_kv0, RunScale& k_scale, RunScale& v_scale) {
        if (ATTN_HALF) {
            cp_async_wait_all();
            __syncthreads();  // the staged tile is complete; the previous tile's readers of k_s, v_s are done
            load_tiles<ATTN_BLOCK_KV>(k_s, stage_k, nullptr, red[2], k_scale, v_s, stage_v, red[3], v_scale,
                                      ATTN_HEAD_DIM, 0, n_keys - kv0);
            __syncthreads();  // k_s and v_s are written; the staging is read
            if (next_kv0 >= 0) prefetch_kv(next_kv0);
        } else {
            __syncthreads();
            load_tiles<ATTN_BLOCK_KV>(k_s, hs.k, nullptr, red[2], k_scale, v_s, hs.v, red[3], v_scale, ld_kv, kv0,
                                      n_keys);
            __syncthreads();
        }
    };
#endif
    if (ATTN_HALF && tile_begin < tile_end) prefetch_kv(0);

    for (int qt = tile_begin; qt < tile_end; ++qt) {
        const int q_row0 = qt * ATTN_BLOCK_Q;
        // The previous tile's readers of q_s and do_s are done: in the fp16 build at load_tiles' barrier,
        // which its stores follow.
        if (!ATTN_HALF) __syncthreads();
        RunScale q_scale, do_scale;
        load_tiles<ATTN_BLOCK_Q>(q_s, hs.q, bq, red[0], q_scale, do_s, hs.dout, red[1], do_scale, hidden,
                                 q_row0, n_video);
        const float s_q = q_scale.s, s_do = do_scale.s;

        // ---- pass 1: online softmax → log-sum-exp (log2 units), O, and D = rowsum(P ∘ dP) ----
        // D is taken from the same dP products that pass 2 uses (not from dO ∘ O), so each row
        // of dS sums to zero up to rounding: with D from O, the mismatch between the rounding
        // of O and of dP becomes a systematic error in dQ, dWq, dbq and dbk.
        float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f}, d_run[2] = {0.f, 0.f};
        float dp_max = 0.f;  // ATTN_KV_HALF: this thread's largest finite |dP|, for dS's scale (ds_observed_scale)
        float o_acc[NT_HD][4];  // at the scale P_SCALE·v_run.s of the latest tile's operands
        zero<NT_HD>(o_acc);
        RunScale v_run;

        // After pass 2 (if any), the next query tile's pass 1 from key 0, if any.
        const int next_pass = qt + 1 < tile_end ? 0 : -1;
        const int pass2_first = ATTN_KV_PARTS == 1 || kv2_begin < kv2_end ? kv2_begin : next_pass;
        for (int kv0 = 0; kv0 < kv_end; kv0 += ATTN_BLOCK_KV) {
            RunScale k_scale;
            load_kv(kv0, kv0 + ATTN_BLOCK_KV < kv_end ? kv0 + ATTN_BLOCK_KV : pass2_first, k_scale, v_run);
            float s[NT_KV][4], dp[NT_KV][4];
            score_tile<NT_KV>(s, q_s, k_s, r0, kv0, n_keys, score_factor(scale_log2, s_q, k_scale.s), g, t);
            rows_times_t<NT_KV>(dp, do_s, v_s, r0, g, t);  // dP = dO V^T
            unscale<NT_KV>(dp, s_do, v_run.s);
            if (ATTN_KV_HALF) dp_max = max_finite_abs<NT_KV>(dp_max, dp);
            float corr[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // m_run is finite after the first tile (key 0 is valid) and carries over the rest.
                float dot = 0.f;
                const float sum = softmax_tile_row<NT_KV>(s, h, m_run[h], corr[h],
                                                          [&](int n, int i) { dot += s[n][i] * dp[n][i]; });
                // Per-thread partials, summed over the quad at the end.
                l_run[h] = l_run[h] * corr[h] + sum;
                d_run[h] = d_run[h] * corr[h] + dot;
            }
            if (part == 0) {
                const float o_corr[2] = {corr[0] * v_run.ratio, corr[1] * v_run.ratio};
                scale_rows<NT_HD>(o_acc, o_corr);
                store_acc<NT_KV>(p_s, LD_KV, r0, s, P_SCALE, g, t);
                __syncwarp();
                rows_times_add<ATTN_BLOCK_KV>(o_acc, p_s, LD_KV, v_s, r0, g, t);  // O += P V
                __syncwarp();
            }
        }

        if (ATTN_KV_HALF) publish_max(red[2], dp_max);  // read in pass 2, after load_kv's barrier
        // Finish the row statistics and O; write O (the dWo GEMM needs it).
        float lse[2], d_row[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float l = quad_sum(l_run[h]);
            lse[h] = m_run[h] + log2f(l);
            const float inv_l = 1.f / l;
            d_row[h] = quad_sum(d_run[h]) * inv_l;
#pragma unroll
            for (int n = 0; n < NT_HD; ++n) {
                o_acc[n][2 * h] *= inv_l;
                o_acc[n][2 * h + 1] *= inv_l;
            }
        }
        if (part == 0) {
            unscale<NT_HD>(o_acc, P_SCALE, v_run.s);
            add_to_columns<NT_HD>(o_acc, bv_s, t);  // O = P V0 + bv: V's tiles come without bv
            store_o(hs.o, ld_o, q_row0 + r0, n_video, o_acc, g, t, o_half_scale(hidden, inv_t, inv_w, inv_bv),
                    o_lo_offset);
        }

        // ---- pass 2: exact P, dP, dS; dQ in registers; dK, dV per key tile ----
        float dq_acc[NT_HD][4];  // at the scale ds_run.s·k_run.s of the latest tile's operands
        zero<NT_HD>(dq_acc);
        RunScale k_run, ds_run;
        const bool accumulate = qt != tile_begin;

        for (int kv0 = kv2_begin; kv0 < kv2_end; kv0 += ATTN_BLOCK_KV) {
            RunScale v_scale;
            const int next_kv0 = kv0 + ATTN_BLOCK_KV < kv2_end ? kv0 + ATTN_BLOCK_KV : next_pass;
            load_kv(kv0, next_kv0, k_run, v_scale);
            float p[NT_KV][4];
            score_tile<NT_KV>(p, q_s, k_s, r0, kv0, n_keys, score_factor(scale_log2, s_q, k_run.s), g, t);
#pragma unroll
            for (int n = 0; n < NT_KV; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) p[n][i] = exp2f(p[n][i] - lse[i / 2]);

            float dp[NT_KV][4];
            rows_times_t<NT_KV>(dp, do_s, v_s, r0, g, t);  // dP = dO V^T
            unscale<NT_KV>(dp, s_do, v_scale.s);
            store_acc<NT_KV>(p_s, LD_KV, r0, p, P_SCALE, g, t);

            score_grads<NT_KV>(dp, p, d_row, scale);  // dS, in the dp registers
            // D sums over every key tile of the row: the bound takes the largest |V| of them all, through
            // the least own scale pass 1 saw (v_run.least), not this tile's.
            ds_run.update(ATTN_KV_HALF ? ds_observed_scale(red[2], scale) : ds_bound_scale(s_do, v_run.least, scale));
            const float dq_ratio = ds_run.ratio * k_run.ratio;
            if (dq_ratio != 1.f) scale_all<NT_HD>(dq_acc, dq_ratio);  // block-uniform

            // dV = P^T dO and dK = dS^T Q for this key tile, over the block's query rows.
            store_ds<NT_KV, LD_KV>(ds_s, dp, ds_run.s, r0, g, t, [&] {
                block_transposed_product(hs.dv, ld_kv, kv0, n_text, accumulate, p_s, do_s, P_SCALE, s_do, warp, g, t);
            });
            block_transposed_product(hs.dk, ld_kv, kv0, n_text, accumulate, ds_s, q_s, ds_run.s, s_q, warp, g, t);

            rows_times_add<ATTN_BLOCK_KV>(dq_acc, ds_s, LD_KV, k_s, r0, g, t);  // dQ += dS K (this warp's rows)
        }
        unscale<NT_HD>(dq_acc, ds_run.s, k_run.s);

        store_dq(hs.dq, hs.dq_t, hs.dq_sums, ld_o, hidden, q_row0 + r0, n_video, dq_acc, g, t);
    }
}

#else
// The resident kernel: all ATTN_KEYS (≥ n_text, a multiple of 16) keys and values of the head
// stay in shared memory for the whole chunk, so each query tile takes one pass: the exact
// softmax of a whole row is in registers (no second pass, no log-sum-exp), and the block's dK
// and dV accumulate in registers over its query tiles, stored once at the end.
// Shared memory: 2 (K, V) + 2 (Q, dO) row tiles, P and dS (one tile in the fp32 build, store_ds);
// for ≤ 80 keys two blocks per SM with
// 64-row tiles, one with 128-row tiles (ATTN_RESIDENT_MIN_BLOCKS, set by the launcher).
// The P/dS stride is ≡ 8 (mod 32) floats, as LD_HD (see there for the bank conflicts); with wgmma
// every tile is unpadded 8×8 core matrices (operand_offset).
// With ATTN_KEY_SPLIT = 2 each 16 query rows are owned by a pair of warps: warp w takes rows
// (w % ROW_WARPS)·16 with keys [part·NK/2, +NK/2) for S, the softmax and dP (part = w / ROW_WARPS;
// the pair exchanges row maxima, sums and D through shared memory under a barrier of its own),
// and head-dim columns [part·head_dim/2, +head_dim/2) of O and dQ (from whole rows of P in p_s and
// of dS in ds_s); the dK and dV tiles are dealt over all the warps. Twice the warps on a tile, each with
// half the chain of dependent instructions: on the small cases one tile is all an SM has.
#if ATTN_WGMMA
#define LD_P ATTN_KEYS  // core matrices (operand_offset)
#else
#define LD_P ((ATTN_KEYS + 31) / 32 * 32 + 8)
#endif
static_assert(ATTN_KEYS % (16 * ATTN_KEY_SPLIT) == 0, "each warp's keys are whole 16-row mma tiles");
static_assert(ATTN_KEY_SPLIT == 1 || (ATTN_KEY_SPLIT == 2 && ATTN_HALF), "keys split in two, with fp16 operands");

// The barrier of the ATTN_KEY_SPLIT warps that own query rows [16·row_group, +16) (ids from 1: 0 is
// __syncthreads'); a __syncwarp when one warp owns them.
__device__ __forceinline__ void row_sync(int row_group) {
    if (ATTN_KEY_SPLIT > 1)
        asm volatile("bar.sync %0, %1;" ::"r"(1 + row_group), "r"(32 * ATTN_KEY_SPLIT) : "memory");
    else
        __syncwarp();
}

#ifndef ATTN_RESIDENT_MIN_BLOCKS
#define ATTN_RESIDENT_MIN_BLOCKS 2
#endif

#if ATTN_WGMMA
// dK and dV of the block's chunk from the wgmma builds' dK^T and dV^T accumulators (warp w holds
// head-dim rows 16w + g (+ 8), keys 8j + 2t (+ 1)); rows past n_text are padding.
template <int NT>
__device__ __forceinline__ void store_transposed_dk_dv(float* dk, float* dv, long long ld_kv, int n_text,
                                                       const float (&dk_acc)[NT][4], const float (&dv_acc)[NT][4],
                                                       int warp, int g, int t) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = 8 * j + 2 * t + (i & 1), dim = 16 * warp + g + 8 * (i >> 1);
            if (key < n_text) {
                dk[key * ld_kv + dim] = dk_acc[j][i];
                dv[key * ld_kv + dim] = dv_acc[j][i];
            }
        }
}
#endif

#ifndef ATTN_LEAN
#define ATTN_LEAN 0  // 1: attn_bwd_lean in place of attn_bwd_resident (its wgmma build's)
#endif
#ifndef ATTN_QDO_HALF
#define ATTN_QDO_HALF 0  // attn_bwd_lean: Q0 and dO in fp16 (the fp16 mode's)
#endif
static_assert(!ATTN_LEAN || (ATTN_WGMMA && !ATTN_SPLIT3 && ATTN_KEY_SPLIT == 1 && ATTN_BLOCK_Q == 64 &&
                             ATTN_KV_PARTS == 1), "attn_bwd_lean: a wgmma build of 64 query rows");
static_assert(!ATTN_QDO_HALF || (ATTN_LEAN && ATTN_KV_HALF && ATTN_O_HALF && !ATTN_DQ_TRANSPOSED),
              "attn_bwd_lean's fp16 Q0 and dO: the fp16 mode's build, fp16 K0|V0 and O");
#if ATTN_QDO_HALF
typedef unsigned short qdo_t;  // fp16 bits
#else
typedef float qdo_t;
#endif

#if ATTN_LEAN
// attn_bwd_resident's math with a shorter chain a tile (perf-notes, Session 30) on sm_90a. Every
// product is a wgmma: S = Q K^T and dP = dO V^T together; then P and dS stay in registers as the A
// operands of O = P V and dQ = dS K, and go to shared memory once for dV^T += dO^T P and
// dK^T += Q^T dS, the four chains in flight together. The next query tile's Q and dO are copied
// by cp.async while this one is used: with ATTN_QDO_HALF (the fp16 mode), as fp16 from their
// GEMMs straight into the operand tiles (Q = Q0 + bq: its GEMM adds bq, at the scale *q_scale that
// the first conversion's rescale writes, half_scaling.cu's write_product_bias; dO at [K0 | V0]'s
// alpha: product_half_scale); otherwise as fp32 into a staging, from which load_tiles stores them
// at per-tile scales (with bq), as attn_bwd_resident does from global memory. dS's scale comes
// from the block's largest |dP| (ds_observed_scale, as the streamed kernel's). Same arguments as
// attn_bwd_resident, and s_Q and 1 / s_Wo (the copy's inverse scale) after them (ATTN_QDO_HALF
// only, else null).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 2)
attn_bwd_lean(const qdo_t* __restrict__ q0, const kv_t* __restrict__ kv0, const float* const* __restrict__ biases,
              const qdo_t* __restrict__ dout, o_t* __restrict__ o, float* __restrict__ dq,
              float* __restrict__ dkv_part, const int* __restrict__ text_lengths, int n_video, int n_text, int hidden,
              int ld_o, int tiles_per_chunk, float scale, const float* __restrict__ inv_t,
              const float* __restrict__ inv_w, const float* __restrict__ inv_bv, const float* __restrict__ inv_dy,
              float* __restrict__ inv_o, float* __restrict__ alpha_o, long long o_lo_offset,
              const float* __restrict__ inv_kv, float* __restrict__ dq_t, float* __restrict__ dq_sums,
              const float* __restrict__ q_scale, const float* __restrict__ inv_wo) {
    wait_for_inputs();
    constexpr int NK = ATTN_KEYS, NT_K = NK / 8, NT_HD = ATTN_HEAD_DIM / 8, TILE = ATTN_BLOCK_Q * LD_HD;
    constexpr int Q_BUFFERS = 1 + ATTN_QDO_HALF;  // fp16 inputs: this tile's and the next
    extern __shared__ __align__(128) float4 smem4[];  // 128-byte core matrices
    operand_t* k_s = reinterpret_cast<operand_t*>(smem4);  // [NK][LD_HD]
    operand_t* v_s = k_s + NK * LD_HD;                      // [NK][LD_HD]
    operand_t* q_tiles = v_s + NK * LD_HD;                  // [Q_BUFFERS][ATTN_BLOCK_Q][LD_HD]
    operand_t* do_tiles = q_tiles + Q_BUFFERS * TILE;       // [Q_BUFFERS][ATTN_BLOCK_Q][LD_HD]
    operand_t* p_s = do_tiles + Q_BUFFERS * TILE;           // [ATTN_BLOCK_Q][LD_P]: P
    operand_t* ds_s = p_s + ATTN_BLOCK_Q * LD_P;            // [ATTN_BLOCK_Q][LD_P]: dS
    // fp32 inputs: the next Q and dO tiles as they are, [2][ATTN_BLOCK_Q][ATTN_HEAD_DIM]
    float* staging = reinterpret_cast<float*>(ds_s + ATTN_BLOCK_Q * LD_P);
    __shared__ float red[5][ATTN_THREADS / 32];  // block maxima: |dP| of the tile, Q, dO, K, V
    __shared__ __align__(8) float bv_s[ATTN_HEAD_DIM];  // bv (stage_value_bias)

    const int col = blockIdx.y * ATTN_HEAD_DIM;
    const auto hs = head_slices(q0, kv0, dout, o, dq, dkv_part, n_video, n_text, hidden, ld_o, dq_t, dq_sums);
    // The scalars first: the tile copies' inline asm orders every memory access, so a load written
    // after them is issued after them and its use waits out its whole round trip (ncu, fp16
    // 64x128x77: 13 % of the kernel's stall samples at two such uses; perf-notes Session 36).
    const int n_keys = load_after_wait(text_lengths + blockIdx.z);  // keys this sample attends to (1 ≤ n_keys ≤ n_text)
#if ATTN_QDO_HALF
    // The copies' inverse scales (half_scaling.cu's slots), in registers; the scale helpers, which
    // read through pointers, then read these.
    const float s_q = load_after_wait(q_scale), scales_in[5] = {load_after_wait(inv_t), load_after_wait(inv_w),
                                                                load_after_wait(inv_bv), load_after_wait(inv_dy),
                                                                load_after_wait(inv_wo)};
    inv_t = scales_in;
    inv_w = scales_in + 1;
    inv_bv = scales_in + 2;
    inv_dy = scales_in + 3;
    inv_wo = scales_in + 4;
#endif
    const float* const bv_column = load_after_wait(biases + 2) + col;  // read between the copies (below)
    publish_o_scale(hidden, inv_t, inv_w, inv_bv, inv_dy, inv_o, alpha_o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = 16 * warp;
    const long long ld_kv = 2LL * hidden;
    const float scale_log2 = scale * 1.4426950408889634f;
    const int n_q_tiles = (n_video + ATTN_BLOCK_Q - 1) / ATTN_BLOCK_Q;
    const int first = blockIdx.x * tiles_per_chunk, last = min(first + tiles_per_chunk, n_q_tiles);
#if ATTN_QDO_HALF
    copy_half_tile<ATTN_BLOCK_Q>(q_tiles, hs.q, hidden, first * ATTN_BLOCK_Q, n_video);
    copy_half_tile<ATTN_BLOCK_Q>(do_tiles, hs.dout, hidden, first * ATTN_BLOCK_Q, n_video);
    const float s_do = product_half_scale(hidden, inv_dy, inv_wo);
#else
    float* q_stage = staging;
    float* do_stage = staging + ATTN_BLOCK_Q * ATTN_HEAD_DIM;
    prefetch_tile<ATTN_BLOCK_Q>(q_stage, hs.q, hidden, first * ATTN_BLOCK_Q, n_video);
    prefetch_tile<ATTN_BLOCK_Q>(do_stage, hs.dout, hidden, first * ATTN_BLOCK_Q, n_video);
    RunScale q_run, do_run;  // the tiles' scales (the runs dK^T and dV^T accumulate over)
#endif
    const float bv = value_bias_column(bv_column);
    const float2 s_kv = load_keys_values<NK, false>(k_s, v_s, hs, n_keys, hidden, inv_t, inv_w, inv_kv, red[3], red[4]);
    const float s_k = s_kv.x, s_v = s_kv.y;
    cp_async_commit();
    stage_value_bias(bv_s, bv);  // read after the first tile's barriers
    const float s_o = o_half_scale(hidden, inv_t, inv_w, inv_bv);

    float dk_acc[NT_K][4], dv_acc[NT_K][4];  // dK^T at ds_run.s · s_q, dV^T at P_SCALE · s_do (the latest tile's)
    zero<NT_K>(dk_acc);
    zero<NT_K>(dv_acc);
    RunScale ds_run;
    for (int qt = first; qt < last; ++qt) {
        const int q_row0 = qt * ATTN_BLOCK_Q;
#if ATTN_QDO_HALF
        const int buf = (qt - first) & 1;
        operand_t* q_s = q_tiles + buf * TILE;
        operand_t* do_s = do_tiles + buf * TILE;
        cp_async_wait_all();
        fence_operands();
        __syncthreads();  // this tile's Q and dO (and K, V) are stored; the last tile's products are done
        if (qt + 1 < last) {
            copy_half_tile<ATTN_BLOCK_Q>(q_tiles + (buf ^ 1) * TILE, hs.q, hidden, q_row0 + ATTN_BLOCK_Q, n_video);
            copy_half_tile<ATTN_BLOCK_Q>(do_tiles + (buf ^ 1) * TILE, hs.dout, hidden, q_row0 + ATTN_BLOCK_Q, n_video);
            cp_async_commit();
        }
        const float q_ratio = 1.f;
#else
        operand_t* q_s = q_tiles;
        operand_t* do_s = do_tiles;
        cp_async_wait_all();
        __syncthreads();  // this tile's staging is in; the last tile's products are done
        load_tiles<ATTN_BLOCK_Q>(q_s, q_stage, biases[0] + col, red[1], q_run, do_s, do_stage, red[2], do_run,
                                 ATTN_HEAD_DIM, 0, n_video - q_row0);
        if (do_run.ratio != 1.f) scale_all<NT_K>(dv_acc, do_run.ratio);  // block-uniform
        const float s_q = q_run.s, s_do = do_run.s, q_ratio = q_run.ratio;
        fence_operands();
        __syncthreads();  // the operand tiles are stored; the staging is read
        if (qt + 1 < last) {
            prefetch_tile<ATTN_BLOCK_Q>(q_stage, hs.q, hidden, q_row0 + ATTN_BLOCK_Q, n_video);
            prefetch_tile<ATTN_BLOCK_Q>(do_stage, hs.dout, hidden, q_row0 + ATTN_BLOCK_Q, n_video);
        }
#endif
        float p[NT_K][4], dp[NT_K][4];
        wg_issue<NK, 0, 0>(p, q_s, ATTN_HEAD_DIM, k_s, ATTN_HEAD_DIM, ATTN_HEAD_DIM / 16, false);
        wg_issue<NK, 0, 0>(dp, do_s, ATTN_HEAD_DIM, v_s, ATTN_HEAD_DIM, ATTN_HEAD_DIM / 16, false);
        wg_wait();
        pin_accumulators<NK>(p);
        pin_accumulators<NK>(dp);
        unscale<NT_K>(dp, s_do, s_v);
        publish_max(red[0], max_finite_abs<NT_K>(0.f, dp));  // read after the barrier below
        mask_scores<NT_K>(p, 0, n_keys, score_factor(scale_log2, s_q, s_k), t);
        float d_row[2];  // D = rowsum(P ∘ dP) of rows g and g + 8
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float norm = 1.f / exp_row<NT_K, false>(p, h).y;  // every row has a key: n_keys ≥ 1
            float dot = 0.f;
#pragma unroll
            for (int n = 0; n < NT_K; ++n)
#pragma unroll
                for (int i = 2 * h; i < 2 * h + 2; ++i) dot += (p[n][i] *= norm) * dp[n][i];
            d_row[h] = quad_sum(dot);
        }
        score_grads<NT_K>(dp, p, d_row, scale);  // dS, in the dp registers
        unsigned p_frag[NK / 16][4], ds_frag[NK / 16][4];
        store_fragments<NT_K>(p_s, LD_P, r0, p, P_SCALE, g, t, p_frag);  // P's scale is fixed: before the wait
        __syncthreads();  // red[0]: the tile's largest |dP|
        ds_run.update(ds_observed_scale(red[0], scale));
        const float dk_ratio = ds_run.ratio * q_ratio;
        if (dk_ratio != 1.f) scale_all<NT_K>(dk_acc, dk_ratio);  // block-uniform
        store_fragments<NT_K>(ds_s, LD_P, r0, dp, ds_run.s, g, t, ds_frag);
        fence_operands();
        __syncthreads();  // every row of P and dS is stored
        float o_acc[NT_HD][4], dq_acc[NT_HD][4];
        wg_issue_rs<1>(o_acc, p_frag, v_s, ATTN_HEAD_DIM);    // O = P V0
        wg_issue_rs<1>(dq_acc, ds_frag, k_s, ATTN_HEAD_DIM);  // dQ = dS K
        wg_issue<NK, 1, 1>(dv_acc, do_s, ATTN_HEAD_DIM, p_s, LD_P, ATTN_BLOCK_Q / 16, true);  // dV^T += dO^T P
        wg_issue<NK, 1, 1>(dk_acc, q_s, ATTN_HEAD_DIM, ds_s, LD_P, ATTN_BLOCK_Q / 16, true);  // dK^T += Q^T dS
        wg_wait();
        pin_accumulators<ATTN_HEAD_DIM>(o_acc);
        pin_accumulators<ATTN_HEAD_DIM>(dq_acc);
        pin_accumulators<NK>(dv_acc);
        pin_accumulators<NK>(dk_acc);
        unscale<NT_HD>(o_acc, P_SCALE, s_v);
        add_to_columns<NT_HD>(o_acc, bv_s, t);  // O = P V0 + bv
        store_o<NT_HD>(hs.o, ld_o, q_row0 + r0, n_video, o_acc, g, t, s_o, o_lo_offset);
        unscale<NT_HD>(dq_acc, ds_run.s, s_k);
        store_dq<NT_HD>(hs.dq, hs.dq_t, hs.dq_sums, ld_o, hidden, q_row0 + r0, n_video, dq_acc, g, t);
    }
#if ATTN_QDO_HALF
    unscale<NT_K>(dk_acc, ds_run.s, s_q);
    unscale<NT_K>(dv_acc, P_SCALE, s_do);
#else
    unscale<NT_K>(dk_acc, ds_run.s, q_run.s);
    unscale<NT_K>(dv_acc, P_SCALE, do_run.s);
#endif
    store_transposed_dk_dv<NT_K>(hs.dk, hs.dv, ld_kv, n_text, dk_acc, dv_acc, warp, g, t);
}
#else

extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_RESIDENT_MIN_BLOCKS)
attn_bwd_resident(const float* __restrict__ q0, const kv_t* __restrict__ kv0,
                  const float* const* __restrict__ biases, const float* __restrict__ dout, o_t* __restrict__ o,
                  float* __restrict__ dq, float* __restrict__ dkv_part, const int* __restrict__ text_lengths,
                  int n_video, int n_text, int hidden, int ld_o, int tiles_per_chunk, float scale,
                  const float* __restrict__ inv_t, const float* __restrict__ inv_w, const float* __restrict__ inv_bv,
                  const float* __restrict__ inv_dy, float* __restrict__ inv_o, float* __restrict__ alpha_o,
                  long long o_lo_offset, const float* __restrict__ inv_kv, float* __restrict__ dq_t,
                  float* __restrict__ dq_sums) {
    wait_for_inputs();
    constexpr int NK = ATTN_KEYS, ROW_WARPS = ATTN_BLOCK_Q / 16;
    constexpr int NT_K = NK / ATTN_KEY_SPLIT / 8, NT_HD = ATTN_HEAD_DIM / ATTN_KEY_SPLIT / 8;  // this warp's part
    using Tiles = TransposedTiles<NK>;  // this warp's 16 × 8 tiles of dK (and of dV)
    constexpr int PER_WARP = Tiles::N;
    extern __shared__ __align__(ATTN_WGMMA ? 128 : 16) float4 smem4[];  // wgmma: 128-byte core matrices
    operand_t* k_s = reinterpret_cast<operand_t*>(smem4);  // [NK][LD_HD]
    operand_t* v_s = k_s + NK * LD_HD;                      // [NK][LD_HD]
    operand_t* q_s = v_s + NK * LD_HD;                      // [ATTN_BLOCK_Q][LD_HD]
    operand_t* do_s = q_s + ATTN_BLOCK_Q * LD_HD;           // [ATTN_BLOCK_Q][LD_HD]
    operand_t* p_s = do_s + ATTN_BLOCK_Q * LD_HD;           // [ATTN_BLOCK_Q][LD_P]: P
    operand_t* ds_s = ATTN_HALF ? p_s + ATTN_BLOCK_Q * LD_P : p_s;  // [ATTN_BLOCK_Q][LD_P]: dS (see store_ds)
    __shared__ float red[4][ATTN_THREADS / 32];  // block maxima: K, V, Q, dO (ATTN_KV_HALF: red[1] max|V|)
    __shared__ __align__(8) float bv_s[ATTN_HEAD_DIM];  // bv (stage_value_bias)
    __shared__ float2 part_row[ATTN_KEY_SPLIT][ATTN_BLOCK_Q];  // each key part's row max and sum
    __shared__ float part_d[ATTN_KEY_SPLIT][ATTN_BLOCK_Q];     // ... and its part of D

    const int col = blockIdx.y * ATTN_HEAD_DIM;  // biases: see attn_bwd
    const auto hs = head_slices(q0, kv0, dout, o, dq, dkv_part, n_video, n_text, hidden, ld_o, dq_t, dq_sums);
    const int n_keys = text_lengths[blockIdx.z];  // keys this sample attends to (padding: 1 ≤ n_keys ≤ n_text)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // (Without the split, part is 0 at compile time: as warp / ROW_WARPS, nvcc 13 kept the offsets
    // below in registers and the 3xTF32 build spilled.)
    const int row_group = ATTN_KEY_SPLIT > 1 ? warp % ROW_WARPS : warp;
    const int part = ATTN_KEY_SPLIT > 1 ? warp / ROW_WARPS : 0;
    const int r0 = row_group * 16;
    const int key0 = part * NT_K * 8, col0 = part * NT_HD * 8;  // this warp's first key, first column of O and dQ
    const float scale_log2 = scale * 1.4426950408889634f;
    const long long ld_kv = 2LL * hidden;
    publish_o_scale(hidden, inv_t, inv_w, inv_bv, inv_dy, inv_o, alpha_o);
    // ATTN_KV_HALF: V's largest |element| (red[1]) is read after the first query tile's barrier.
    const float2 s_kv = load_keys_values<NK, true>(k_s, v_s, hs, n_keys, hidden, inv_t, inv_w, inv_kv, red[0], red[1]);
    const float s_k = s_kv.x, s_v = s_kv.y;
    stage_value_bias(bv_s, value_bias_column(biases[2] + col));

    // dK and dV accumulate over the query tiles at the latest tile's operand scales,
    // ds_run.s·q_run.s and P_SCALE·do_run.s (attention_common.cuh).
    float dk_acc[PER_WARP][4], dv_acc[PER_WARP][4];
    zero<PER_WARP>(dk_acc);
    zero<PER_WARP>(dv_acc);
    RunScale q_run, do_run, ds_run;
#if ATTN_WGMMA
    // The warpgroup takes dV^T = dO^T P and dK^T = Q^T dS: warp w holds head-dim rows 16w + g (+ 8),
    // keys 8j + 2t (+ 1).
    static_assert(PER_WARP == NK / 8, "dK^T, dV^T: NK / 8 column tiles a warp");
#else
    // acc += A^T B for this warp's tiles (A = P in p_s or dS in ds_s, B = dO or Q).
    auto add_transposed = [&](float (&acc)[PER_WARP][4], const operand_t* a_s, const operand_t* b_s) {
        accumulate<PER_WARP>(acc, [&](float (&hi)[PER_WARP][4], float (&lo)[PER_WARP][4]) {
            transposed_products<NK>(hi, lo, a_s, LD_P, b_s, warp, g, t);
        });
    };
#endif

    const int n_q_tiles = (n_video + ATTN_BLOCK_Q - 1) / ATTN_BLOCK_Q;
    const int tile_begin = blockIdx.x * tiles_per_chunk;
    const int tile_end = min(tile_begin + tiles_per_chunk, n_q_tiles);
    for (int qt = tile_begin; qt < tile_end; ++qt) {
        const int q_row0 = qt * ATTN_BLOCK_Q;
        // The previous tile's readers of q_s, do_s, p_s and ds_s are done (and, at the first tile, K and V
        // are stored): in the fp16 build at load_tiles' barrier, which its stores follow.
        if (!ATTN_HALF) __syncthreads();
        load_tiles<ATTN_BLOCK_Q>(q_s, hs.q, biases[0] + col, red[2], q_run, do_s, hs.dout, red[3], do_run,
                                 hidden, q_row0, n_video);
        if (do_run.ratio != 1.f) scale_all<PER_WARP>(dv_acc, do_run.ratio);  // block-uniform
        const float s_q = q_run.s, s_do = do_run.s;
        // Each warp stored its own 16 rows of Q and dO (TileIn) and reads only them until store_ds's
        // barrier; with the keys split, the two warps of 16 rows read what two other warps stored, and
        // with wgmma the warpgroup's products read all of them (and, at the first tile, K and V).
        fence_operands();
        if (ATTN_KEY_SPLIT > 1 || ATTN_WGMMA) __syncthreads(); else __syncwarp();

        // P = softmax(S) exactly, from the whole row: this warp's part of it, then the row's parts.
        float p[NT_K][4];
#if ATTN_WGMMA
        // S = Q K^T and dP = dO V^T need only the stored tiles: two chains in flight at once.
        float dp[NT_K][4];
        wg_issue<NK, 0, 0>(p, q_s, ATTN_HEAD_DIM, k_s, ATTN_HEAD_DIM, ATTN_HEAD_DIM / 16, false);
        wg_issue<NK, 0, 0>(dp, do_s, ATTN_HEAD_DIM, v_s, ATTN_HEAD_DIM, ATTN_HEAD_DIM / 16, false);
        wg_wait();
        pin_accumulators<NK>(p);
        pin_accumulators<NK>(dp);
        mask_scores<NT_K>(p, key0, n_keys, score_factor(scale_log2, s_q, s_k), t);
#else
        score_tile<NT_K>(p, q_s, k_s + key0 * LD_HD, r0, key0, n_keys, score_factor(scale_log2, s_q, s_k), g, t);
#endif
        float norm[2];  // what this part's exp2(s − its max) is multiplied by
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 row = exp_row<NT_K, true>(p, h);  // (max, sum)
            norm[h] = 1.f / row.y;
            if (ATTN_KEY_SPLIT > 1 && t == 0) part_row[part][r0 + g + 8 * h] = row;
        }
        if (ATTN_KEY_SPLIT > 1) {
            row_sync(row_group);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = r0 + g + 8 * h;
                float row_max = neg_inf(), row_sum = 0.f;
#pragma unroll
                for (int k = 0; k < ATTN_KEY_SPLIT; ++k) row_max = fmaxf(row_max, part_row[k][row].x);
#pragma unroll
                for (int k = 0; k < ATTN_KEY_SPLIT; ++k)
                    row_sum += part_row[k][row].y * exp2f(part_row[k][row].x - row_max);
                norm[h] = exp2f(part_row[part][row].x - row_max) / row_sum;
            }
        }
#pragma unroll
        for (int n = 0; n < NT_K; ++n) {
            p[n][0] *= norm[0], p[n][1] *= norm[0];
            p[n][2] *= norm[1], p[n][3] *= norm[1];
        }
        // O = P V first: fewer registers are live than while dP is held too.
        store_acc<NT_K>(p_s + key0, LD_P, r0, p, P_SCALE, g, t);
        fence_operands();
        if (ATTN_WGMMA) __syncthreads(); else row_sync(row_group);  // the row's P, all its parts (wgmma: every row)
        {
            float o_acc[NT_HD][4];
            zero<NT_HD>(o_acc);
            rows_times_add<NK, NT_HD>(o_acc, p_s, LD_P, v_s + col0, r0, g, t);
            unscale<NT_HD>(o_acc, P_SCALE, s_v);
            add_to_columns<NT_HD>(o_acc, bv_s + col0, t);  // O = P V0 + bv
            store_o<NT_HD>(hs.o + (ATTN_O_TRANSPOSED ? (long long)col0 * ld_o : col0), ld_o, q_row0 + r0, n_video,
                           o_acc, g, t, o_half_scale(hidden, inv_t, inv_w, inv_bv), o_lo_offset);
        }
        // dP = dO V^T and D = rowsum(P ∘ dP), from the same products as dS (see attn_bwd).
        float d_row[2];
#if !ATTN_WGMMA
        float dp[NT_K][4];
        rows_times_t<NT_K>(dp, do_s, v_s + key0 * LD_HD, r0, g, t);
#endif
        unscale<NT_K>(dp, s_do, s_v);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float dot = 0.f;
#pragma unroll
            for (int n = 0; n < NT_K; ++n) dot += p[n][2 * h] * dp[n][2 * h] + p[n][2 * h + 1] * dp[n][2 * h + 1];
            d_row[h] = quad_sum(dot);
            if (ATTN_KEY_SPLIT > 1 && t == 0) part_d[part][r0 + g + 8 * h] = d_row[h];
        }
        if (ATTN_KEY_SPLIT > 1) {
            row_sync(row_group);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                d_row[h] = 0.f;
#pragma unroll
                for (int k = 0; k < ATTN_KEY_SPLIT; ++k) d_row[h] += part_d[k][r0 + g + 8 * h];
            }
        }
        score_grads<NT_K>(dp, p, d_row, scale);  // dS, in the dp registers (P is not needed there after)
        ds_run.update(ds_bound_scale(s_do, ATTN_KV_HALF ? v_bound_scale(red[1], s_v) : s_v, scale));
        const float dk_ratio = ds_run.ratio * q_run.ratio;
        if (dk_ratio != 1.f) scale_all<PER_WARP>(dk_acc, dk_ratio);
#if ATTN_WGMMA
        // dV^T += dO^T P, dK^T += Q^T dS and dQ = dS K: three independent chains in flight at once.
        store_ds<NT_K, LD_P>(ds_s, dp, ds_run.s, r0, g, t, [] {});
        {
            float dq_acc[NT_HD][4];
            wg_issue<NK, 1, 1>(dv_acc, do_s, ATTN_HEAD_DIM, p_s, LD_P, ATTN_BLOCK_Q / 16, true);
            wg_issue<NK, 1, 1>(dk_acc, q_s, ATTN_HEAD_DIM, ds_s, LD_P, ATTN_BLOCK_Q / 16, true);
            wg_issue<ATTN_HEAD_DIM, 0, 1>(dq_acc, ds_s, LD_P, k_s, ATTN_HEAD_DIM, NK / 16, false);
            wg_wait();
            pin_accumulators<NK>(dv_acc);
            pin_accumulators<NK>(dk_acc);
            pin_accumulators<ATTN_HEAD_DIM>(dq_acc);
            unscale<NT_HD>(dq_acc, ds_run.s, s_k);
            store_dq<NT_HD>(hs.dq, hs.dq_t, hs.dq_sums, ld_o, hidden, q_row0 + r0, n_video, dq_acc, g, t);
        }
#else
        store_ds<NT_K, LD_P>(ds_s + key0, dp, ds_run.s, r0, g, t,
                             [&] { add_transposed(dv_acc, p_s, do_s); });  // dV += P^T dO
        add_transposed(dk_acc, ds_s, q_s);  // dK += dS^T Q
        {
            float dq_acc[NT_HD][4];
            zero<NT_HD>(dq_acc);
            rows_times_add<NK, NT_HD>(dq_acc, ds_s, LD_P, k_s + col0, r0, g, t);  // dQ = dS K
            unscale<NT_HD>(dq_acc, ds_run.s, s_k);
            store_dq<NT_HD>(hs.dq + col0, ATTN_DQ_TRANSPOSED ? hs.dq_t + (long long)col0 * ld_o : nullptr,
                            ATTN_DQ_TRANSPOSED ? hs.dq_sums + col0 : nullptr, ld_o, hidden, q_row0 + r0, n_video,
                            dq_acc, g, t);
        }
#endif
    }
    unscale<PER_WARP>(dk_acc, ds_run.s, q_run.s);
    unscale<PER_WARP>(dv_acc, P_SCALE, do_run.s);

    // This chunk's dK and dV (rows past n_text are padding).
#if ATTN_WGMMA
    store_transposed_dk_dv<PER_WARP>(hs.dk, hs.dv, ld_kv, n_text, dk_acc, dv_acc, warp, g, t);
#else
#pragma unroll
    for (int j = 0; j < PER_WARP; ++j) {
        const int n0 = Tiles::col(j, warp, t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = Tiles::row(j, g, h);
            if (row < n_text) {
                *reinterpret_cast<float2*>(hs.dk + row * ld_kv + n0) = make_float2(dk_acc[j][2 * h], dk_acc[j][2 * h + 1]);
                *reinterpret_cast<float2*>(hs.dv + row * ld_kv + n0) = make_float2(dv_acc[j][2 * h], dv_acc[j][2 * h + 1]);
            }
        }
    }
#endif
}
#endif  // ATTN_LEAN
#endif

// sum[i] = Σ_c parts[c][i], summed in part order (deterministic): the query chunks' dK/dV, the key
// parts' dQ. n4 = element count / 4.
extern "C" __global__ void attn_sum_parts(const float4* __restrict__ parts, float4* __restrict__ sum, long long n4,
                                          int n_parts) {
    wait_for_inputs();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        float4 acc = parts[i];
        for (int c = 1; c < n_parts; ++c) {
            const float4 v = parts[c * n4 + i];
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
        sum[i] = acc;
    }
}
