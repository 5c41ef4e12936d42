// fp32 ↔ fp16 by PTX (not cuda_fp16.h, so that NVRTC needs no toolkit headers), round to nearest.

// fp16 of lo in the low half (first in memory), of hi in the high half.
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// x rounded to fp16 and back.
__device__ __forceinline__ float half_round(float x) {
    unsigned short h;
    float r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}

// What the fp16 copy of x leaves out (exact in fp32), the fp32 mode's remainder; 0 where x or its
// copy is not finite (Inf − Inf would be NaN).
__device__ __forceinline__ float remainder_of_half(float x) {
    const float h = half_round(x);
    return isfinite(x) && isfinite(h) ? x - h : 0.f;
}

// The exponent k of a power of two 2^k in fp32's normal range (or of a normal float's leading bit;
// -127 for 0 and subnormals), and 2^k from k in [-126, 127]: the scales are powers of two, and
// their arithmetic is done on exponents (no division, nothing flushed or rounded).
__device__ __forceinline__ int exponent_of(float x) { return static_cast<int>(__float_as_uint(x) >> 23) - 127; }
__device__ __forceinline__ float pow2(int k) { return __uint_as_float(static_cast<unsigned>(k + 127) << 23); }

// The exponent of s = 2^e_alpha · s_a · s_b, the scale of an fp16 GEMM's output at alpha 2^e_alpha
// over copies at scales s_a = 1 / inv_a and s_b = 1 / inv_b, clamped to fp32's normal range.
__device__ __forceinline__ int product_scale_exponent(int e_alpha, float inv_a, float inv_b) {
    return min(max(e_alpha - exponent_of(inv_a) - exponent_of(inv_b), -126), 126);
}

// |x| where x is finite, else 0: maxima over finite elements only (an Inf or NaN does not set a scale).
__device__ __forceinline__ float finite_abs(float x) {
    const float a = fabsf(x);
    return a < __int_as_float(0x7f800000) ? a : 0.f;
}
