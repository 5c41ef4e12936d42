// fp32 → (hi, lo) pairs for the fp32 mode's 3xTF32 GEMMs.
//
// cuBLAS has no fp32-accurate tensor-core GEMM; the fp32 mode computes each product A·B as
// three TF32 GEMMs accumulated in fp32, lo_A·hi_B + hi_A·lo_B + hi_A·hi_B, where
//   hi = x rounded to TF32 (the low 13 mantissa bits zero, so the GEMM reads it exactly, whether
//        its conversion rounds or truncates), and
//   lo = x − hi, exact in fp32, |lo| ≤ 2^-11 |x|; the GEMM's TF32 reading of lo is off by at most
//        2^-10 |lo| ≤ 2^-21 |x| (truncated; half that if rounded).
// What is left out, lo_A·lo_B and those TF32 readings of lo, is ~2^-20 relative to |A|·|B|; the
// tensor cores' fp32 accumulation over thousands of terms costs more (docs/perf-notes.md).
// Non-finite x: hi = x and lo = 0 (x − x would be NaN); an Inf still meets lo = 0 of the other
// operand in the correction products, so outputs it touches may be NaN where fp32 gives Inf.
// Finite x that round to Inf (|x| ≥ 0x7f7ff000, ~3.4e38) are truncated instead.
//
// A group of n tensors is split by one launch, blockIdx.y picking the tensor: sources[i] is a slot
// of the plan's pointer table (the caller's arrays move from call to call); meta holds n4[i]
// (element count / 4), then hi[i], then lo[i] (destination addresses). A destination may be its
// own source (an in-place split): each element is read before it is written, by the same thread.

#define SPLIT_THREADS 256

__device__ __forceinline__ float tf32_round(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
}

__device__ __forceinline__ void split(float x, float& hi, float& lo) {
    if (!isfinite(x)) {
        hi = x, lo = 0.f;
        return;
    }
    hi = tf32_round(x);
    if (isinf(hi)) hi = __uint_as_float(__float_as_uint(x) & 0xffffe000u);  // rounded past the largest float
    lo = x - hi;
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
tf32_split(const float4* const* __restrict__ sources, const long long* __restrict__ meta, int n) {
    const int i = blockIdx.y;
    const float4* x = sources[i];
    float4* hi = reinterpret_cast<float4*>(meta[n + i]);
    float4* lo = reinterpret_cast<float4*>(meta[2 * n + i]);
    const long long n4 = meta[i];
    for (long long j = blockIdx.x * (long long)SPLIT_THREADS + threadIdx.x; j < n4;
         j += (long long)gridDim.x * SPLIT_THREADS) {
        const float4 v = x[j];
        float4 h, l;
        split(v.x, h.x, l.x);
        split(v.y, h.y, l.y);
        split(v.z, h.z, l.z);
        split(v.w, h.w, l.w);
        hi[j] = h;
        lo[j] = l;
    }
}
