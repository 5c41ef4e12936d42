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
// Grid (⌈rows/32⌉, ⌈cols/32⌉, n) blocks of 32 × 8 threads (rows on x: B·Nv of them may exceed
// gridDim.y's 65535 tiles), one 32 × 32 tile each, through shared memory so that reads and writes
// are both whole rows of 128 bytes.

#define TR_TILE 32
#define TR_ROWS 8

extern "C" __global__ void __launch_bounds__(TR_TILE * TR_ROWS)
transposed_copies(const float* const* __restrict__ src, float* __restrict__ dst, long long dst_step, int rows,
                  int cols, long long ld) {
    __shared__ float tile[TR_TILE][TR_TILE + 1];  // +1: the column reads hit 32 banks
    const float* __restrict__ s = src[blockIdx.z];
    float* __restrict__ d = dst + blockIdx.z * dst_step;
    const int x = blockIdx.y * TR_TILE + threadIdx.x;  // source column
    const int y0 = blockIdx.x * TR_TILE;               // first source row
#pragma unroll
    for (int r = threadIdx.y; r < TR_TILE; r += TR_ROWS)
        if (y0 + r < rows && x < cols) tile[r][threadIdx.x] = s[(long long)(y0 + r) * cols + x];
    __syncthreads();
    const int out_col = y0 + threadIdx.x;  // S^T(i, j) = S(j, i)
#pragma unroll
    for (int r = threadIdx.y; r < TR_TILE; r += TR_ROWS) {
        const int out_row = blockIdx.y * TR_TILE + r;
        if (out_row < cols && out_col < rows) d[out_row * ld + out_col] = tile[threadIdx.x][r];
    }
}
