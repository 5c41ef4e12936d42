// Transposed copies, for the TF32 GEMMs.
//
// On sm_90 the TF32 tensor-core GEMMs read both operands K-major (wgmma transposes only 16-bit
// operands). cuBLAS ran a K-major × N-major product ("nn") at ~230 TFLOP/s on the 8192 × 1024 ×
// 1024 shapes against ~320 for K-major × K-major ("tn"), and the weight gradients, both operands
// N-major ("nt"), at ~185 against ~360 "tn" (scripts/lt_probe.py). So the tf32 mode reads W^T in
// dO = dY Wo, dX = dQ Wq and dT = [dK | dV] [Wk; Wv], and the transposes of both operands in
// every weight gradient (O^T comes from the attention kernel, the others from here).
//
// transposed_copies: for i < n, S_i^T as row-major [cols][ld] at dst + i·dst_step (ld ≥ rows;
// columns past rows untouched), where src is a device array of n addresses of row-major
// [rows][cols] matrices (consecutive entries of the plan's pointer table, since the caller's
// arrays move from call to call). Side by side ([W_0^T | W_1^T | W_2^T]): dst_step = rows,
// ld = n·rows; apart: dst_step = cols·ld.
// Grid (⌈rows/64⌉, ⌈cols/64⌉, n) blocks of 256 threads (rows on x: B·Nv of them may exceed
// gridDim.y's 65535 tiles), one 64 × 64 tile each, through shared memory so that reads and writes
// are both whole rows. Each thread has all its loads in flight before it stores any: 32 × 32
// tiles of one float a thread moved ~3.0 TB/s on 8192 × 1024 (the copy rate is 4.2).
// With sums (not null), the blocks of matrices i ≥ sum_from also write the column sums of their
// tile rows, in a fixed order (no atomics): sums[(i − sum_from)·gridDim.x + blockIdx.x][cols], of
// which a ones-row GEMM makes the bias gradients (the column sums of dY, dQ, [dK | dV]) without
// another pass over those tensors.
// TR_VEC = 4: float4 loads and stores (cols, ld and dst_step multiples of 4, 16-byte aligned
// matrices); TR_VEC = 1: floats, for any shape.

#include "grid_dependency.cuh"

#ifndef TR_VEC
#define TR_VEC 4
#endif
#define TR_TILE 64
#define TR_THREADS 256
#define TR_TX (TR_TILE / TR_VEC)    // threads along a tile row
#define TR_TY (TR_THREADS / TR_TX)  // tile rows per pass
#define TR_PASSES (TR_TILE / TR_TY)

__device__ __forceinline__ void load_vec(const float* p, float (&v)[TR_VEC]) {
#if TR_VEC == 4
    const float4 t = *reinterpret_cast<const float4*>(p);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
#else
    v[0] = *p;
#endif
}

// The first n (≤ TR_VEC) of v at p: one vector store when all of them are written.
__device__ __forceinline__ void store_vec(float* p, const float (&v)[TR_VEC], int n) {
#if TR_VEC == 4
    if (n >= 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
        return;
    }
#endif
#pragma unroll
    for (int j = 0; j < TR_VEC; ++j)
        if (j < n) p[j] = v[j];
}

extern "C" __global__ void __launch_bounds__(TR_THREADS)
transposed_copies(const float* const* __restrict__ src, float* __restrict__ dst, long long dst_step, int rows,
                  int cols, long long ld, float* __restrict__ sums, int sum_from) {
    wait_for_inputs();
    __shared__ float tile[TR_TILE][TR_TILE + 1];  // +1: the column reads spread over the banks
    __shared__ float quarter_sums[TR_THREADS / TR_TILE][TR_TILE];
    const float* __restrict__ s = src[blockIdx.z];
    float* __restrict__ d = dst + blockIdx.z * dst_step;
    const int tx = threadIdx.x % TR_TX, ty = threadIdx.x / TR_TX;
    const int y0 = blockIdx.x * TR_TILE, x0 = blockIdx.y * TR_TILE;  // first source row, column
    const int x = x0 + tx * TR_VEC;
    float v[TR_PASSES][TR_VEC] = {};
#pragma unroll
    for (int i = 0; i < TR_PASSES; ++i)
        if (y0 + ty + i * TR_TY < rows && x < cols) load_vec(s + (long long)(y0 + ty + i * TR_TY) * cols + x, v[i]);
#pragma unroll
    for (int i = 0; i < TR_PASSES; ++i)
#pragma unroll
        for (int j = 0; j < TR_VEC; ++j) tile[ty + i * TR_TY][tx * TR_VEC + j] = v[i][j];
    __syncthreads();
    if (sums != nullptr && (int)blockIdx.z >= sum_from) {  // rows past `rows` hold zeros (v's start)
        const int c = threadIdx.x % TR_TILE, q = threadIdx.x / TR_TILE, span = TR_TILE * TR_TILE / TR_THREADS;
        float sum = 0.f;
#pragma unroll
        for (int r = 0; r < span; ++r) sum += tile[q * span + r][c];
        quarter_sums[q][c] = sum;
        __syncthreads();
        if (threadIdx.x < TR_TILE && x0 + c < cols) {
            sum = 0.f;
#pragma unroll
            for (int k = 0; k < TR_THREADS / TR_TILE; ++k) sum += quarter_sums[k][c];
            sums[((long long)(blockIdx.z - sum_from) * gridDim.x + blockIdx.x) * cols + x0 + c] = sum;
        }
    }
    const int out_col = y0 + tx * TR_VEC;  // S^T(c, r) = S(r, c): TR_VEC source rows of one column
#pragma unroll
    for (int i = 0; i < TR_PASSES; ++i) {
        const int c = ty + i * TR_TY;
        float w[TR_VEC];
#pragma unroll
        for (int j = 0; j < TR_VEC; ++j) w[j] = tile[tx * TR_VEC + j][c];
        if (x0 + c < cols && out_col < rows) store_vec(d + (x0 + c) * ld + out_col, w, rows - out_col);
    }
}
