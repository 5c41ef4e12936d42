// Transposed copies of square weight matrices, for the TF32 GEMMs.
//
// On sm_90 the TF32 tensor-core GEMMs read both operands K-major (wgmma transposes only 16-bit
// operands); cuBLAS's kernels for a K-major × N-major product ("nn") ran at ~230 TFLOP/s on the
// 8192 × 1024 × 1024 shapes, against ~320 for K-major × K-major ("tn"), and picked 8-block tilings
// for dT on short texts. The products with a weight on the right, dO = dY Wo, dX = dQ Wq and
// dT = [dK | dV] [Wk; Wv], become K-major × K-major with W^T in place of W.
//
// weights_transposed: dst = [W_0^T | W_1^T | … | W_{n−1}^T], row-major [d][n·d], where w is a
// device array of n addresses of row-major [d][d] matrices (a slot of the plan's pointer table,
// since the caller's arrays move from call to call).
// Grid (d/32, d/32, n) blocks of 32 × 8 threads, one 32 × 32 tile each, through shared memory
// so that reads and writes are both whole rows of 128 bytes.

#define WT_TILE 32
#define WT_ROWS 8

extern "C" __global__ void __launch_bounds__(WT_TILE * WT_ROWS)
weights_transposed(const float* const* __restrict__ w, int n, float* __restrict__ dst, int d) {
    __shared__ float tile[WT_TILE][WT_TILE + 1];  // +1: the column reads hit 32 banks
    const float* __restrict__ src = w[blockIdx.z];
    const int x = blockIdx.x * WT_TILE + threadIdx.x;  // source column
    const int y0 = blockIdx.y * WT_TILE;               // first source row
#pragma unroll
    for (int r = threadIdx.y; r < WT_TILE; r += WT_ROWS)
        if (y0 + r < d && x < d) tile[r][threadIdx.x] = src[(long long)(y0 + r) * d + x];
    __syncthreads();
    const long long ld = (long long)n * d;
    const int out_col = blockIdx.z * d + y0 + threadIdx.x;  // W^T(i, j) = W(j, i)
#pragma unroll
    for (int r = threadIdx.y; r < WT_TILE; r += WT_ROWS) {
        const int out_row = blockIdx.x * WT_TILE + r;
        if (out_row < d && y0 + threadIdx.x < d) dst[out_row * ld + out_col] = tile[threadIdx.x][r];
    }
}
