// fp32 → fp16 with a per-tensor power-of-two scale, for the fp16 precision mode (and the fp32
// mode's copies and remainders).
//
// A tensor x is stored as half(x · s) with s = 2^(HALF_TARGET_EXP − e), where 2^e is the
// smallest power of two above max|x| (or, below, the previous run's s). So the largest element
// lands just under 2^HALF_TARGET_EXP (far from fp16's 65504: nothing overflows) and small tensors
// (gradients of 1e-8) are lifted into fp16's normal range, keeping its 11-bit relative precision
// down to 2^-26 · max|x|.
// Powers of two make the scaling exact; a GEMM on two scaled tensors is undone by
// alpha = (1/s_a)·(1/s_b).
//
// s depends on max|x|, known only after a pass over x. The copy is made in that same pass with
// a guess, the scale the slot had in the previous run (1 at first), and the guess stands while it
// puts max|x| within [2^(HALF_TARGET_EXP − 2), 2^(HALF_TARGET_EXP + 1)) (still far from 65504):
// the max of a random input wanders across a power of two from one run to the next, and an exact
// rule rewrote such tensors every other run. Powers of two scale exactly, so the guess changes
// only elements that land in fp16's subnormal range (below 2^-26 · max|x|; the fp32 mode's
// remainders, below 2^-15 · max|x|) by their last bits; a tensor outside the window is written again.
//   half_copy_absmax: y = half(x · guess[slot]); amax_bits[p][slot] = max(…, bits(max|x|)), with
//                     p = parity[slot]; copied[slot] = guess[slot], copied_parity[slot] = p;
//                     amax_bits[1 − p][slot] = 0 (the buffer that the slot's next copy takes)
//   half_rescale:     s = copied if within the window, else from amax_bits[copied_parity][slot];
//                     if s ≠ copied, y = half(x · s);
//                     then its block 0: inv_scale[slot] = 1/s, guess[slot] = s, parity[slot] = 1 − p,
//                     alpha[i·n + j] = inv_scale[i] · inv_scale[j] for all n slots; and where the
//                     group has one, a GEMM's bias at that GEMM's output scale (write_product_bias)
// Each kernel reads only what an earlier kernel wrote: the rescale's blocks read what the copy
// recorded, never what the rescale's block 0 writes, and the two amax buffers take turns, so the
// copy can clear the one the rescale does not read. No block waits for another (a counter of
// finished blocks, so that the last one wrote the state, took ~1.5 µs of the rescale's ~3.7).
//
// max|x| is taken over the finite elements (as unsigned float bits: non-negative floats order like
// their bits), so an Inf or NaN does not set the scale of the rest; it is copied as Inf or NaN.
//
// The fp32 mode (3xFP16) also keeps what the fp16 copy left out: lo = half(x · s − float(y)), the
// remainder (exact in fp32, s being a power of two) rounded to fp16 at the same scale, so a
// product A·B is recovered to ~2^-22 as (y_A·y_B + y_A·lo_B + lo_A·y_B) · alpha. A remainder of
// an Inf or NaN is 0 (Inf − Inf would be NaN).

#include "grid_dependency.cuh"
#include "half.cuh"

#ifndef HALF_TARGET_EXP
#define HALF_TARGET_EXP 14
#endif
#define HALF_THREADS 256
#define HALF_UNROLL 4  // float4 loads in flight per thread (for_each_quad)

// A group of tensors is converted by one launch each of half_copy_absmax (blockIdx.y picks the
// tensor) and half_rescale (every block takes its share of each tensor). sources[i] is a slot of
// the plan's pointer table (the caller's arrays move from call to call); meta holds, for n
// tensors, n4[i] (element count / 4), then dest[i] (the fp16 copy's address), then slot[i] (its
// scale slot; tensors may share one), then lo[i] (the remainder's address, 0 for none), then
// sums[i] (below; 0 for none), then parts[i] and part4[i]: x is the sum of parts[i] ≥ 1 slices of
// the source part4[i] float4s apart, added in slice order (the attention's dK/dV partials of its
// query chunks and dQ's of its key parts, summed here instead of by a pass of their own), then the
// six entries of a GEMM's bias that the rescale writes (write_product_bias; its fp32 source is
// sources[n]).
//
// Column sums (the bias gradients of dY, dQ, [dK | dV]), in the copy's pass over x: with x a
// row-major [rows][4·cols4] matrix and gridDim.x·HALF_THREADS a multiple of cols4 (the launcher
// rounds the grid up), every step of a thread's grid-stride loop lands on the same four columns,
// so it sums them in registers; thread g writes its sums, in a fixed order (no atomics), at
// sums[g / cols4][4·(g % cols4) …]: gridDim.x·HALF_THREADS / cols4 rows of partial column sums,
// which a ones-row GEMM adds up.
__device__ __forceinline__ long long group_n4(const long long* meta, int i) { return meta[i]; }
__device__ __forceinline__ uint2* group_dest(const long long* meta, int n, int i) {
    return reinterpret_cast<uint2*>(meta[n + i]);
}
__device__ __forceinline__ int group_slot(const long long* meta, int n, int i) { return (int)meta[2 * n + i]; }
__device__ __forceinline__ uint2* group_lo(const long long* meta, int n, int i) {
    return reinterpret_cast<uint2*>(meta[3 * n + i]);
}
__device__ __forceinline__ float4* group_sums(const long long* meta, int n, int i) {
    return reinterpret_cast<float4*>(meta[4 * n + i]);
}
__device__ __forceinline__ int group_parts(const long long* meta, int n, int i) { return (int)meta[5 * n + i]; }
__device__ __forceinline__ long long group_part4(const long long* meta, int n, int i) { return meta[6 * n + i]; }

// The scaler's state (HalfScaler in half_scaling.py: one buffer, n_slots entries per part but alpha).
struct ScalerState {
    unsigned* amax_bits;      // [2][n_slots]: max|x| as float bits, the copy's buffer by parity
    float* inv_scale;         // 1 / s after the last rescale
    float* guess;             // the scale the next copy takes
    float* copied;            // the scale the last copy took
    unsigned* parity;         // the amax buffer the next copy takes
    unsigned* copied_parity;  // the one the last copy took
    float* alpha;             // [n_slots][n_slots]: inv_scale[i] · inv_scale[j]
};

__device__ __forceinline__ ScalerState scaler_state(float* state, int n_slots) {
    return {reinterpret_cast<unsigned*>(state), state + 2 * n_slots, state + 3 * n_slots, state + 4 * n_slots,
            reinterpret_cast<unsigned*>(state + 5 * n_slots), reinterpret_cast<unsigned*>(state + 6 * n_slots),
            state + 7 * n_slots};
}

// The scale of a slot whose max|x| has bits amax_bits, after a copy at scale `guess`: the guess
// while it puts max|x| within the window above, else 2^(HALF_TARGET_EXP − e) (1 with no finite
// element other than 0, for which any scale is exact).
__device__ __forceinline__ float pow2_scale(unsigned amax_bits, float guess) {
    const float amax = __uint_as_float(amax_bits);
    const float copied_max = amax * guess;  // 0 or Inf at the extremes: outside the window
    if (copied_max >= ldexpf(1.f, HALF_TARGET_EXP - 2) && copied_max < ldexpf(1.f, HALF_TARGET_EXP + 1))
        return guess;
    if (!(amax > 0.f) || amax_bits >= 0x7f800000u) return 1.f;
    int e;
    frexpf(amax, &e);  // amax < 2^e
    return ldexpf(1.f, min(HALF_TARGET_EXP - e, 126));
}

// Sources are read here once (again only by a rescale) and the GEMMs read the fp16 copies: the
// sources are read evict-first, so that they do not push the copies out of L2.
__device__ __forceinline__ float4 load_streaming(const float4* p) {
    float4 v;
    asm("ld.global.cs.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// The largest of the block's values, in every thread, for values that are non-negative floats given
// as their bits (which then order as the floats do). One barrier; each kernel calls it once.
__device__ __forceinline__ unsigned block_max_bits(unsigned bits) {
    for (int off = 16; off > 0; off /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, off));
    __shared__ unsigned warp_max[HALF_THREADS / 32];
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
    __syncthreads();
    for (int w = 0; w < HALF_THREADS / 32; ++w) bits = max(bits, warp_max[w]);
    return bits;
}

// y[j] = half(v · s), and lo[j] = its remainder when lo is not null.
__device__ __forceinline__ void store_scaled(uint2* y, uint2* lo, long long j, float4 v, float s) {
    const float a = v.x * s, b = v.y * s, c = v.z * s, d = v.w * s;
    y[j] = make_uint2(pack_half2(a, b), pack_half2(c, d));
    if (lo != nullptr)
        lo[j] = make_uint2(pack_half2(remainder_of_half(a), remainder_of_half(b)),
                           pack_half2(remainder_of_half(c), remainder_of_half(d)));
}

__device__ __forceinline__ void add_to(float4& v, float4 w) { v.x += w.x, v.y += w.y, v.z += w.z, v.w += w.w; }

// each(j, x[j]) for j = j0, j0 + stride, … < n4, HALF_UNROLL loads in flight before each is called
// (one at a time, the copy moved ~2.5–3.4 TB/s; the copy rate is ~4); x[j] = Σ_c src[j + c · part4]
// over c < parts, added in order.
template <typename Each>
__device__ __forceinline__ void for_each_quad(const float4* src, int parts, long long part4, long long n4,
                                              long long j0, long long stride, Each each) {
    for (; j0 < n4; j0 += HALF_UNROLL * stride) {
        float4 v[HALF_UNROLL];
#pragma unroll
        for (int u = 0; u < HALF_UNROLL; ++u)
            v[u] = j0 + u * stride < n4 ? load_streaming(src + j0 + u * stride) : make_float4(0.f, 0.f, 0.f, 0.f);
        for (int c = 1; c < parts; ++c) {
#pragma unroll
            for (int u = 0; u < HALF_UNROLL; ++u)
                if (j0 + u * stride < n4) add_to(v[u], load_streaming(src + c * part4 + j0 + u * stride));
        }
#pragma unroll
        for (int u = 0; u < HALF_UNROLL; ++u)
            if (j0 + u * stride < n4) each(j0 + u * stride, v[u]);
    }
}

extern "C" __global__ void __launch_bounds__(HALF_THREADS)
half_copy_absmax(const float4* const* __restrict__ sources, const long long* __restrict__ meta, int n,
                 float* __restrict__ state, int n_slots) {
    wait_for_inputs();
    launch_dependents();  // the rescale's blocks take their slots now, not behind a GEMM issued beside
    const ScalerState st = scaler_state(state, n_slots);
    const int i = blockIdx.y;
    const int slot = group_slot(meta, n, i);
    const float s = st.guess[slot];
    const unsigned p = st.parity[slot];
    if (blockIdx.x == 0 && threadIdx.x == 0) {  // tensors sharing a slot write the same values
        st.copied[slot] = s;
        st.copied_parity[slot] = p;
        st.amax_bits[(1 - p) * n_slots + slot] = 0u;  // its reader, the rescale after the slot's last copy, has run
    }
    const float4* x = sources[i];
    uint2* y = group_dest(meta, n, i);
    uint2* lo = group_lo(meta, n, i);
    const long long n4 = group_n4(meta, i);
    float4* sums = group_sums(meta, n, i);
    float m = 0.f;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    const long long g = blockIdx.x * (long long)HALF_THREADS + threadIdx.x;
    const int parts = group_parts(meta, n, i);
    const long long part4 = group_part4(meta, n, i);
    for_each_quad(x, parts, part4, n4, g, (long long)gridDim.x * HALF_THREADS, [&](long long j, float4 v) {
        store_scaled(y, lo, j, v, s);
        m = fmaxf(m, fmaxf(fmaxf(finite_abs(v.x), finite_abs(v.y)), fmaxf(finite_abs(v.z), finite_abs(v.w))));
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    });
    if (sums != nullptr) sums[g] = sum;  // [g / cols4][g % cols4] of float4s: the layout above
    const unsigned bits = block_max_bits(__float_as_uint(m));
    if (threadIdx.x == 0) atomicMax(st.amax_bits + p * n_slots + slot, bits);  // max is order-independent: deterministic
}

// A GEMM's bias at the scale of the GEMM's fp16 output, from the scales of its operands' copies
// (HalfScaler.group's product_bias; spec: length (0: none), slot_a, slot_b, alpha's float bits, the
// fp16 bias's address, out's). The GEMM (cuBLASLt's bias epilogue) writes alpha · (a·s_a)(b·s_b) +
// bias as fp16, each sum of products of the copies under 2^14 by alpha (the fp16 mode's Q0 = X Wq^T
// + bq at alpha kv_half_alpha): (a b + bias) · s with s = alpha · s_a · s_b, if bias is bias · s. That
// can pass 2^14 where |bias| is large against a b, so both are taken times 2^-k, k the least that
// keeps (2^14 + max|bias · s|) · 2^-k under 2^15 (0 on benchmark-like inputs): out = {alpha · 2^-k, s · 2^-k}
// (the GEMM's alpha and the scale of its output) and bias = half(bias · s · 2^-k). Powers of two in
// exponents, clamped to fp32's normal range (product_scale_exponent, as attn_bwd's). Block 0 of the
// rescale, every thread; the first PRODUCT_BIAS_CACHED pairs a thread takes are loaded at the
// kernel's start (load_product_bias), so that their latency overlaps the reads of the scales.
#define PRODUCT_BIAS_CACHED 2
struct ProductBias {
    const float2* source;  // null: none (or not block 0)
    long long pairs;
    float2 cached[PRODUCT_BIAS_CACHED];  // pairs threadIdx.x + r · HALF_THREADS
};

__device__ __forceinline__ ProductBias load_product_bias(const float4* const* source_entry, const long long* spec) {
    ProductBias b{nullptr, 0, {}};
    if (blockIdx.x != 0 || spec[0] == 0) return b;
    b.source = reinterpret_cast<const float2*>(*source_entry);
    b.pairs = spec[0] / 2;
#pragma unroll
    for (int r = 0; r < PRODUCT_BIAS_CACHED; ++r) {
        const long long p = threadIdx.x + r * HALF_THREADS;
        b.cached[r] = p < b.pairs ? b.source[p] : make_float2(0.f, 0.f);
    }
    return b;
}

// each(p, pair p) over this thread's pairs, the cached ones first.
template <typename Each>
__device__ __forceinline__ void for_each_pair(const ProductBias& b, Each each) {
#pragma unroll
    for (int r = 0; r < PRODUCT_BIAS_CACHED; ++r) {
        const long long p = threadIdx.x + r * HALF_THREADS;
        if (p < b.pairs) each(p, b.cached[r]);
    }
    for (long long p = threadIdx.x + PRODUCT_BIAS_CACHED * HALF_THREADS; p < b.pairs; p += HALF_THREADS) each(p, b.source[p]);
}

__device__ void write_product_bias(const ProductBias& b, const long long* spec, const float* inv) {
    if (b.source == nullptr) return;
    const float alpha = __int_as_float(static_cast<int>(spec[3]));
    const int e_s = product_scale_exponent(exponent_of(alpha), inv[spec[1]], inv[spec[2]]);
    const float s = pow2(e_s);
    float m = 0.f;
    for_each_pair(b, [&](long long, float2 v) { m = fmaxf(m, fmaxf(finite_abs(v.x * s), finite_abs(v.y * s))); });
    m = __uint_as_float(block_max_bits(__float_as_uint(m)));
    const int e_out = max(e_s - max(exponent_of(16384.f + m) - 14, 0), -126);  // 2^14 + m < 2^(exponent + 1)
    const float f = pow2(e_out);
    unsigned* bias = reinterpret_cast<unsigned*>(spec[4]);  // pairs of fp16
    for_each_pair(b, [&](long long p, float2 v) { bias[p] = pack_half2(v.x * f, v.y * f); });
    if (threadIdx.x == 0) {
        float* out = reinterpret_cast<float*>(spec[5]);
        out[0] = alpha * pow2(e_out - e_s);
        out[1] = f;
    }
}

// half_rescale runs a block per two SMs (half_scaling.py says why), each taking its share of every
// tensor whose scale changed: when the guesses stand (every run after the first, unless a tensor's
// max leaves the window of the run that set its scale) its blocks only check and leave, and block 0
// writes the state.
extern "C" __global__ void __launch_bounds__(HALF_THREADS)
half_rescale(const float4* const* __restrict__ sources, const long long* __restrict__ meta, int n,
             float* __restrict__ state, int n_slots) {
    wait_for_inputs();
    const ProductBias bias = load_product_bias(sources + n, meta + 7 * n);
    const ScalerState st = scaler_state(state, n_slots);
    // Thread i < n (≤ HALF_THREADS) finds tensor i's scale, all of them at once: a block that took
    // them one after the other waited n times for the chain meta → copied_parity → amax_bits.
    __shared__ float new_scale[HALF_THREADS];  // 0: the copy stands (the guess was right)
    int slot = 0;
    float s = 1.f;
    if (threadIdx.x < n) {
        slot = group_slot(meta, n, threadIdx.x);
        const float copied = st.copied[slot];
        s = pow2_scale(st.amax_bits[st.copied_parity[slot] * n_slots + slot], copied);
        new_scale[threadIdx.x] = s == copied ? 0.f : s;
    }
    __syncthreads();
    const long long g = blockIdx.x * (long long)HALF_THREADS + threadIdx.x;
    for (int i = 0; i < n; ++i) {
        const float scale = new_scale[i];
        if (scale == 0.f) continue;
        uint2* y = group_dest(meta, n, i);
        uint2* lo = group_lo(meta, n, i);
        for_each_quad(sources[i], group_parts(meta, n, i), group_part4(meta, n, i), group_n4(meta, i), g,
                      (long long)gridDim.x * HALF_THREADS,
                      [&](long long j, float4 v) { store_scaled(y, lo, j, v, scale); });
    }
    if (blockIdx.x != 0) return;
    __shared__ float inv[HALF_THREADS];  // every slot's 1 / s after this group (n_slots ≤ HALF_THREADS)
    if (threadIdx.x < n_slots) inv[threadIdx.x] = st.inv_scale[threadIdx.x];
    __syncthreads();
    if (threadIdx.x < n) {  // over the old value; a shared slot's are equal
        inv[slot] = 1.f / s;
        st.guess[slot] = s;
        st.parity[slot] = 1u - st.copied_parity[slot];
    }
    __syncthreads();
    for (int k = threadIdx.x; k < n_slots * n_slots; k += HALF_THREADS) st.alpha[k] = inv[k / n_slots] * inv[k % n_slots];
    if (threadIdx.x < n_slots) st.inv_scale[threadIdx.x] = inv[threadIdx.x];
    write_product_bias(bias, meta + 7 * n, inv);
}
