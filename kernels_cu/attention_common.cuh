// Shared by the attention kernels (attention_fwd.cu, attention_bwd.cu): compile-time knobs,
// mma.sync TF32 products on shared-memory tiles, the tile loader and the softmax helpers.
//
// Matrix products use mma.sync m16n8k8 TF32 with fp32 accumulation. ATTN_SPLIT3 = 1 gives the
// fp32 mode: each operand x = big + small (big = x truncated to TF32, small = the remainder; see
// split_tf32()), and a·b is big·big + big·small + small·big, which restores about fp32 accuracy.
// A block of ATTN_THREADS threads works on ATTN_BLOCK_Q query rows; each warp owns 16 rows.
// ATTN_UNROLL_K (default 16, full) is the unrolling of the k loops of the warp products.

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

#define ATTN_THREADS (ATTN_BLOCK_Q / 16 * 32)
constexpr int kUnrollK = ATTN_UNROLL_K;
// Row strides in shared memory, in floats. Stride ≡ 8 (mod 32) makes the [row t][col g] fragment
// reads of a warp (load_b, load_a_trans) hit 32 different banks; the [row g][col t] reads
// (load_a, load_b_trans) are then 2-way conflicts (rows g and g + 4 share banks). No stride serves
// both orders: fragment-ordered layouts (or ldmatrix) would.
#define LD_HD (ATTN_HEAD_DIM + 8)
#define LD_KV (ATTN_BLOCK_KV + 8)

static_assert(ATTN_BLOCK_Q % 16 == 0, "a warp owns 16 query rows");
static_assert(ATTN_BLOCK_KV % 16 == 0, "key/value tiles are whole 16-row mma tiles");
static_assert(ATTN_HEAD_DIM % 16 == 0, "head_dim must be a multiple of 16");

namespace {

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

// Copy rows [row0, row0 + ROWS) of a head's ATTN_HEAD_DIM columns into shared memory, adding a bias
// (may be null); rows at or past n_valid become zeros so padded rows contribute nothing.
// Every load of a thread is issued before the first store: one global-memory latency per
// tile instead of one per row group (the stores to shared memory would otherwise wait).
template <int ROWS>
__device__ __forceinline__ void load_tile(float* dst, const float* __restrict__ src, long long ld_src,
                                          int row0, int n_valid, const float* __restrict__ bias) {
    constexpr int VEC_PER_ROW = ATTN_HEAD_DIM / 4, N = ROWS * VEC_PER_ROW;
    constexpr int PER_THREAD = (N + ATTN_THREADS - 1) / ATTN_THREADS;
    static_assert(ATTN_THREADS % VEC_PER_ROW == 0, "a thread keeps its column across its rows");
    const int c = (threadIdx.x % VEC_PER_ROW) * 4, r_first = threadIdx.x / VEC_PER_ROW;
    constexpr int R_STEP = ATTN_THREADS / VEC_PER_ROW;
    float4 v[PER_THREAD];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int r = r_first + j * R_STEP;
        v[j] = (r < ROWS && row0 + r < n_valid)
                   ? *reinterpret_cast<const float4*>(src + (long long)(row0 + r) * ld_src + c)
                   : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const float4 b = bias ? *reinterpret_cast<const float4*>(bias + c) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int r = r_first + j * R_STEP;
        if (r >= ROWS) break;
        const bool valid = row0 + r < n_valid;
        const float4 x = v[j];
        *reinterpret_cast<float4*>(dst + r * LD_HD + c) =
            valid ? make_float4(to_operand(x.x + b.x), to_operand(x.y + b.y), to_operand(x.z + b.z),
                                to_operand(x.w + b.w))
                  : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// The k loop of this warp's products A·B over K: A = its 16 rows of a_s ([rows][ld_a]), B = b_s
// (row stride LD_HD) read as [K][NT·8] or, with B_TRANS, as [NT·8][K]; mma(hi[n], lo[n], …) for
// each of the NT column tiles. rows_times_t and rows_times_add give it their accumulators.
template <int NT, int K, bool B_TRANS>
__device__ __forceinline__ void rows_products(float hi[NT][4], float lo[NT][4], const float* a_s, int ld_a,
                                              const float* b_s, int r0, int g, int t) {
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
}

// c = A B^T for this warp's 16 rows of A (a_s) and the first NT·8 rows of B (b_s), both
// row-major [rows][head_dim] in shared memory: S = Q K^T and dP = dO V^T.
template <int NT>
__device__ __forceinline__ void rows_times_t(float c[NT][4], const float* a_s, const float* b_s, int r0, int g,
                                             int t) {
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

// acc += A B for this warp's 16 rows of A (p_s: P or dS, [rows][ld_p], K columns) and B (v_s or
// k_s: [K][head_dim]): O += P V and dQ += dS K.
template <int K>
__device__ __forceinline__ void rows_times_add(float (&acc)[ATTN_HEAD_DIM / 8][4], const float* p_s, int ld_p,
                                               const float* b_s, int r0, int g, int t) {
    constexpr int NT = ATTN_HEAD_DIM / 8;
    accumulate<NT>(acc, [&](float (&hi)[NT][4], float (&lo)[NT][4]) {
        rows_products<NT, K, false>(hi, lo, p_s, ld_p, b_s, r0, g, t);
    });
}

// S for NT·8 keys from kv0, scaled to log2 units, keys past n_text masked to −inf.
template <int NT>
__device__ __forceinline__ void score_tile(float s[NT][4], const float* q_s, const float* k_s, int r0, int kv0,
                                           int n_text, float scale_log2, int g, int t) {
    rows_times_t<NT>(s, q_s, k_s, r0, g, t);
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

// Store a warp's 16-row accumulator tile (C layout) to shared memory, as mma operands.
template <int NT>
__device__ __forceinline__ void store_acc(float* m, int ld, int r0, const float c[NT][4], int g, int t) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        *reinterpret_cast<float2*>(m + (r0 + g) * ld + n * 8 + 2 * t) =
            make_float2(to_operand(c[n][0]), to_operand(c[n][1]));
        *reinterpret_cast<float2*>(m + (r0 + g + 8) * ld + n * 8 + 2 * t) =
            make_float2(to_operand(c[n][2]), to_operand(c[n][3]));
    }
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
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

// Store this warp's 16-row accumulator rows [row0 + r0, +16) of a [rows][head_dim] result.
__device__ __forceinline__ void store_rows(float* dst, long long ld, int row0, int n_rows,
                                           const float c[ATTN_HEAD_DIM / 8][4], int g, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + g + 8 * h;
        if (row < n_rows) {
#pragma unroll
            for (int n = 0; n < ATTN_HEAD_DIM / 8; ++n)
                *reinterpret_cast<float2*>(dst + (long long)row * ld + n * 8 + 2 * t) =
                    make_float2(c[n][2 * h], c[n][2 * h + 1]);
        }
    }
}

}  // namespace
