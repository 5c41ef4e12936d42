// Fused attention forward for cross-attention: O = softmax(scale Q K^T) V per (batch, head), with
// Q = Q0 + bq, K = K0 + bk, V = V0 + bv (the projections done by cuBLAS). bq is added to the query
// tile; bk and bv never enter the key/value tiles (as in attention_bwd.cu): bk shifts each row of
// S by a constant, which the softmax takes out, and bv is added to O, as P's rows sum to 1.
// S and P live only in registers and shared memory.
//
// Layouts as in attention_bwd.cu (row-major fp32, heads side by side in D = H·head_dim):
//   q0, o : [B·Nv, D]     kv0 : [B·Nt, 2D] (K0 in columns [0, D), V0 in [D, 2D))
//   biases : device array of the three bias addresses bq, bk (unread), bv     text_lengths : [B] ints
//
// Grid (query tiles, H, B), ATTN_THREADS threads: block (i, h, b) computes rows
// [i·ATTN_BLOCK_Q, +ATTN_BLOCK_Q) of O for head h of sample b, streaming that sample's first
// text_lengths[b] keys and values in tiles of ATTN_BLOCK_KV with an online softmax.

#include "attention_common.cuh"

extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
attn_fwd(const float* __restrict__ q0, const float* __restrict__ kv0, const float* const* __restrict__ biases,
         const int* __restrict__ text_lengths, float* __restrict__ o, int n_video, int n_text, int hidden,
         float scale) {
    wait_for_inputs();
    constexpr int NT_KV = ATTN_BLOCK_KV / 8, NT_HD = ATTN_HEAD_DIM / 8;
    extern __shared__ float4 smem4[];
    float* q_s = reinterpret_cast<float*>(smem4);  // [ATTN_BLOCK_Q][LD_HD]
    float* k_s = q_s + ATTN_BLOCK_Q * LD_HD;        // [ATTN_BLOCK_KV][LD_HD]
    float* v_s = k_s + ATTN_BLOCK_KV * LD_HD;       // [ATTN_BLOCK_KV][LD_HD]
    float* p_s = v_s + ATTN_BLOCK_KV * LD_HD;       // [ATTN_BLOCK_Q][LD_KV]

    const int head = blockIdx.y, batch = blockIdx.z, col = head * ATTN_HEAD_DIM;
    const long long ld_kv = 2LL * hidden, video = (long long)batch * n_video * hidden + col;
    const float* k = kv0 + (long long)batch * n_text * ld_kv + col;
    const float* v = k + hidden;
    const int n_keys = text_lengths[batch];  // 1 ≤ n_keys ≤ n_text
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int r0 = warp * 16, q_row0 = blockIdx.x * ATTN_BLOCK_Q;
    const float scale_log2 = scale * 1.4426950408889634f;

    load_tile<ATTN_BLOCK_Q>(q_s, q0 + video, hidden, q_row0, n_video, biases[0] + col);
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
    float o_acc[NT_HD][4];
    zero<NT_HD>(o_acc);
    for (int kv_row0 = 0; kv_row0 < n_keys; kv_row0 += ATTN_BLOCK_KV) {
        __syncthreads();  // q_s is written; the previous tile's readers of k_s and v_s are done
        load_tile<ATTN_BLOCK_KV>(k_s, k, ld_kv, kv_row0, n_keys, nullptr);
        load_tile<ATTN_BLOCK_KV>(v_s, v, ld_kv, kv_row0, n_keys, nullptr);
        __syncthreads();
        float s[NT_KV][4];
        score_tile<NT_KV>(s, q_s, k_s, r0, kv_row0, n_keys, scale_log2, g, t);
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // m_run is finite from the first tile on: each tile starts below n_keys
            const float sum = softmax_tile_row<NT_KV>(s, h, m_run[h], corr[h], [](int, int) {});
            l_run[h] = l_run[h] * corr[h] + sum;  // per-thread partial, summed over the quad at the end
        }
        scale_rows<NT_HD>(o_acc, corr);
        store_acc<NT_KV>(p_s, LD_KV, r0, s, 1.f, g, t);
        __syncwarp();
        rows_times_add<ATTN_BLOCK_KV>(o_acc, p_s, LD_KV, v_s, r0, g, t);  // O += P V
        __syncwarp();
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float inv_l = 1.f / quad_sum(l_run[h]);
#pragma unroll
        for (int n = 0; n < NT_HD; ++n) {
            o_acc[n][2 * h] *= inv_l;
            o_acc[n][2 * h + 1] *= inv_l;
        }
    }
    add_to_columns<NT_HD>(o_acc, biases[2] + col, t);  // O = P V0 + bv
    store_rows(o + video, hidden, q_row0 + r0, n_video, o_acc, g, t);
}
