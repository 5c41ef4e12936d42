"""A prototype of the resident attention kernel with a shorter chain a tile (perf-notes, Session 30):
one warpgroup a block, two blocks an SM (as attn_bwd_resident), every product on wgmma, and
nothing between the products but the softmax:

- the next query tile's Q and dO are copied by cp.async while this one is used (fp16 in global
  memory, into the wgmma operand layout as they are: no conversion, no per-tile scale or maximum);
- S = Q K^T and dP = dO V^T in flight together; P and dS stay in registers as the A operands of
  O = P V and dQ = dS K (wgmma with A from registers), and go to shared memory once, for
  dV^T += dO^T P and dK^T += Q^T dS; the four chains in flight together, one wait, one barrier.

Three input forms: fp16 Q, dO, K|V (casts of random fp32 data, no scales); fp32, copied into the
fp16 operands in the kernel at per-tile power-of-two scales (K, V per block), as the library's
kernel does; and Q, dO through a separate per-tile fp16 conversion pass (to_half_tiles, timed with
it). No biases, every key attended to, O row-major: only to time the structure against the
library's kernel (AttentionBackward, tf32: fp32 inputs converted in the kernel), both replayed
from a CUDA graph. Checked against a float32 CuPy reference of the same math
(split_attention_probe's). Measured on the H200 (perf-notes, Session 30): 64x128x77 66.9, 96.2 and
110.7 µs against the library's 106-107; the fp16 form became the fp16 mode's attn_bwd_lean (v63).

Usage: PYTHONPATH=. python3 scripts/lean_attention_probe.py [--reps 50] 64x128x77 8x512x77 2x4096x77
"""
import argparse
import importlib.util
import os

import numpy

_spec = importlib.util.spec_from_file_location("split_attention_probe",
                                               os.path.join(os.path.dirname(__file__), "split_attention_probe.py"))
_split = importlib.util.module_from_spec(_spec)  # its reference and quad reductions
_spec.loader.exec_module(_split)


def _regs(first, count):
    return ", ".join(f"%{first + i}" for i in range(count))


def _outs(n):  # the accumulators c[N/8][4] as asm outputs
    return ", ".join(f'"+f"(c[{i}][{j}])' for i in range(n // 8) for j in range(4))


def _wgmma_source():
    """wgmma m64nNk16 (fp16 in, fp32 accumulators): ss<N, TA, TB> with both operands in shared memory,
    rs<N, TB> with A from four registers (f16x2)."""
    parts = []
    for n in (64, 80):
        k = n // 2
        parts.append(f"""
template <int TA, int TB> __device__ __forceinline__ void ss{n}(float (&c)[{n // 8}][4], unsigned long long da,
                                                               unsigned long long db, int acc) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 2}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{_regs(0, k)}}}, %{k}, %{k + 1}, p, 1, 1, %{k + 3}, %{k + 4};\\n}}\\n"
                 : {_outs(n)} : "l"(da), "l"(db), "r"(acc), "n"(TA), "n"(TB));
}}
template <int TB> __device__ __forceinline__ void rs{n}(float (&c)[{n // 8}][4], const unsigned (&a)[4],
                                                      unsigned long long db, int acc) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 5}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{_regs(0, k)}}}, {{{_regs(k, 4)}}}, %{k + 4}, p, 1, 1, %{k + 6};\\n}}\\n"
                 : {_outs(n)} : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}}""")
    return "\n".join(parts)


SOURCE = r"""
#define HD 64      // head_dim
#define NK 80      // keys, padded to a multiple of 16 (Nt <= 80)
#define BQ 64      // query rows a tile: one warpgroup
#define THREADS 128
typedef unsigned short half_t;  // fp16 bits
#ifndef INPUTS
#define INPUTS 0  // 0: Q, dO, K|V in fp16; 1: in fp32, copied into fp16 operands at per-tile power-of-two
#endif            // scales (K, V per block); 2: Q, dO in fp16 at per-tile scales (to_half_tiles), K|V fp32
#define INPUT_F32 (INPUTS == 1)
#if INPUT_F32
typedef float in_t;
#else
typedef half_t in_t;
#endif
#if INPUTS == 0
typedef half_t kv_in_t;
#else
typedef float kv_in_t;
#endif

// wgmma's no-swizzle layout: 8 x 8 core matrices of 128 contiguous bytes, (row / 8, col / 8) at
// element (row / 8) * cols * 8 + (col / 8) * 64.
__device__ __forceinline__ int cm(int row, int col, int cols) {
    return (row >> 3) * cols * 8 + (col >> 3) * 64 + (row & 7) * 8 + (col & 7);
}
// A tile of `cols` columns as an operand: K along its columns (T = 0: LBO 128 bytes, SBO a row of
// core matrices), or along its rows (T = 1: the two swapped); k step `k` (16 of K) starts 2 LBO on.
template <int T> __device__ __forceinline__ unsigned long long desc(const half_t* tile, int cols, int k) {
    const unsigned lbo = T ? cols * 16 : 128, sbo = T ? 128 : cols * 16;
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(tile)) + 2 * k * lbo;
    return ((address & 0x3ffff) >> 4) | (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(sbo >> 4) << 32);
}
__device__ __forceinline__ void cp16(half_t* to, const half_t* from, bool inside) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(to));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(from), "r"(inside ? 16 : 0) : "memory");
}
__device__ __forceinline__ unsigned pack(float lo, float hi) {  // fp16 of lo in the low half
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void pin(float (&c)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(c[n][i])::"memory");
}
QUAD_REDUCTIONS
WGMMA_SOURCE

// Rows [row0, row0 + BQ) of a head's Q and dO (row stride `hidden`) into tiles, rows past n as zeros:
// fp16, into the operand tiles as they are; fp32, into row-major staging.
__device__ __forceinline__ void copy_tiles(void* q_s, void* do_s, const in_t* q, const in_t* dout, int row0, int n,
                                           int hidden) {
    constexpr int PER = 16 / sizeof(in_t);  // elements a 16-byte copy
#pragma unroll
    for (int i = threadIdx.x; i < BQ * HD / PER; i += THREADS) {
        const int row = i / (HD / PER), c = PER * (i % (HD / PER));
        const bool inside = row0 + row < n;
        const long long at = inside ? (long long)(row0 + row) * hidden + c : 0;
        const int to = INPUT_F32 ? row * HD + c : cm(row, c, HD);
        cp16(reinterpret_cast<half_t*>(static_cast<in_t*>(q_s) + to), reinterpret_cast<const half_t*>(q + at), inside);
        cp16(reinterpret_cast<half_t*>(static_cast<in_t*>(do_s) + to), reinterpret_cast<const half_t*>(dout + at), inside);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// The block's largest value of x (every thread calls it; red: THREADS / 32 floats).
__device__ __forceinline__ float block_max(float x, float* red) {
#pragma unroll
    for (int m = 16; m; m /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, m));
    __syncthreads();  // red's last readers are done
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) x = fmaxf(x, red[w]);
    return x;
}
// A power of two that puts the largest |element| near 2^14 (fp16's top is 65504).
__device__ __forceinline__ float pow2_scale(float amax) {
    return amax > 0.f ? exp2f(14.f - ceilf(log2f(amax))) : 1.f;
}
// ROWS rows of HD fp32 values ([ROWS][HD] with row stride ld) into an fp16 operand tile at a scale
// from their largest |value| (returned): each thread's values stay in registers between the two.
template <int ROWS>
__device__ __forceinline__ float to_half_tile(half_t* tile, const float* from, long long ld, int valid, float* red) {
    constexpr int PER_THREAD = ROWS * HD / 8 / THREADS;  // 8-element chunks
    float4 v[PER_THREAD][2];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int chunk = threadIdx.x + THREADS * i, row = chunk / (HD / 8), c = 8 * (chunk % (HD / 8));
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        v[i][0] = row < valid ? *reinterpret_cast<const float4*>(from + row * ld + c) : zero;
        v[i][1] = row < valid ? *reinterpret_cast<const float4*>(from + row * ld + c + 4) : zero;
        amax = fmaxf(amax, fmaxf(fmaxf(fmaxf(fabsf(v[i][0].x), fabsf(v[i][0].y)), fmaxf(fabsf(v[i][0].z), fabsf(v[i][0].w))),
                                 fmaxf(fmaxf(fabsf(v[i][1].x), fabsf(v[i][1].y)), fmaxf(fabsf(v[i][1].z), fabsf(v[i][1].w)))));
    }
    const float s = pow2_scale(block_max(amax, red));
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int chunk = threadIdx.x + THREADS * i, row = chunk / (HD / 8), c = 8 * (chunk % (HD / 8));
        *reinterpret_cast<uint4*>(tile + cm(row, c, HD)) =
            make_uint4(pack(v[i][0].x * s, v[i][0].y * s), pack(v[i][0].z * s, v[i][0].w * s),
                       pack(v[i][1].x * s, v[i][1].y * s), pack(v[i][1].z * s, v[i][1].w * s));
    }
    return s;
}

// Grid (chunks, H, B); block (c, h, b) takes query tiles [c * tiles, (c + 1) * tiles) of sample b,
// head h, and writes its chunk's dK | dV partial (dkv_part [chunks][B * Nt][2D], fp32).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
lean_attn(const in_t* __restrict__ q, const kv_in_t* __restrict__ kv, const in_t* __restrict__ dout,
          float* __restrict__ o, float* __restrict__ dq, float* __restrict__ dkv_part, int n_video, int n_text,
          int hidden, int tiles, float scale, const float* __restrict__ tile_scales) {
    extern __shared__ __align__(128) half_t smem[];
    half_t* k_s = smem;              // [NK][HD]
    half_t* v_s = k_s + NK * HD;     // [NK][HD]
    half_t* q_s = v_s + NK * HD;     // [2][BQ][HD] (fp32 inputs: one)
    half_t* do_s = q_s + (2 - INPUT_F32) * BQ * HD;
    half_t* p_s = do_s + (2 - INPUT_F32) * BQ * HD;  // [BQ][NK]
    half_t* ds_s = p_s + BQ * NK;      // [BQ][NK]
    float* staging = reinterpret_cast<float*>(ds_s + BQ * NK);  // fp32 inputs: the next Q, dO [2][BQ][HD]
    __shared__ float red[THREADS / 32];
    const int b = blockIdx.z, col = blockIdx.y * HD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const in_t* qb = q + (long long)b * n_video * hidden + col;
    const in_t* dob = dout + (long long)b * n_video * hidden + col;
    const kv_in_t* kb = kv + (long long)b * n_text * 2 * hidden + col;
    const int n_tiles = (n_video + BQ - 1) / BQ, first = blockIdx.x * tiles, last = min(first + tiles, n_tiles);
#if INPUTS
    copy_tiles(INPUT_F32 ? (void*)staging : q_s, INPUT_F32 ? (void*)(staging + BQ * HD) : do_s, qb, dob, first * BQ,
               n_video, hidden);
    const float s_k = to_half_tile<NK>(k_s, kb, 2 * hidden, n_text, red);
    const float s_v = to_half_tile<NK>(v_s, kb + hidden, 2 * hidden, n_text, red);
    float s_q_run = 0.f, s_do_run = 0.f;  // the scales dK^T and dV^T accumulate at
#else
    for (int i = threadIdx.x; i < NK * HD / 8; i += THREADS) {
        const int row = i / (HD / 8), c = 8 * (i % (HD / 8));
        const bool inside = row < n_text;
        const long long at = inside ? (long long)row * 2 * hidden + c : 0;
        cp16(k_s + cm(row, c, HD), kb + at, inside);
        cp16(v_s + cm(row, c, HD), kb + hidden + at, inside);
    }
    copy_tiles(q_s, do_s, qb, dob, first * BQ, n_video, hidden);
    const float s_k = 1.f, s_v = 1.f, s_q = 1.f, s_do = 1.f;
#endif
    const float sl2 = scale * 1.4426950408889634f;
    float dk[NK / 8][4], dv[NK / 8][4];
#pragma unroll
    for (int n = 0; n < NK / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.f;
    for (int tile = first; tile < last; ++tile) {
        const int row0 = tile * BQ;
#if !INPUT_F32  // fp16 tiles, copied as they are: the next tile's while this one is used
        const int buf = (tile - first) & 1;
        half_t* qt = q_s + buf * BQ * HD;
        half_t* dot = do_s + buf * BQ * HD;
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        fence_async();
        __syncthreads();  // this tile's Q and dO are in (and K, V); the last tile's chains are done
        if (tile + 1 < last)
            copy_tiles(q_s + (buf ^ 1) * BQ * HD, do_s + (buf ^ 1) * BQ * HD, qb, dob, row0 + BQ, n_video, hidden);
#endif
#if INPUTS == 2
        const float s_q = tile_scales[(b * gridDim.y + blockIdx.y) * n_tiles + tile];
        const float s_do = tile_scales[((gridDim.z + b) * gridDim.y + blockIdx.y) * n_tiles + tile];
#endif
#if INPUT_F32
        half_t* qt = q_s;
        half_t* dot = do_s;
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();  // this tile's staging is in; the last tile's chains are done
        const float s_q = to_half_tile<BQ>(qt, staging, HD, BQ, red);
        const float s_do = to_half_tile<BQ>(dot, staging + BQ * HD, HD, BQ, red);
#endif
#if INPUTS
        if (s_q != s_q_run) {  // block-uniform: dK^T to this tile's scale
            const float ratio = s_q_run == 0.f ? 0.f : s_q / s_q_run;
#pragma unroll
            for (int n = 0; n < NK / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) dk[n][i] *= ratio;
            s_q_run = s_q;
        }
        if (s_do != s_do_run) {
            const float ratio = s_do_run == 0.f ? 0.f : s_do / s_do_run;
#pragma unroll
            for (int n = 0; n < NK / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) dv[n][i] *= ratio;
            s_do_run = s_do;
        }
#endif
#if INPUT_F32
        fence_async();
        __syncthreads();  // the operand tiles are stored; the staging is read
        if (tile + 1 < last) copy_tiles(staging, staging + BQ * HD, qb, dob, row0 + BQ, n_video, hidden);
#endif
        const float s_factor = sl2 / (s_q * s_k), dp_factor = scale / (s_do * s_v);
        float s[NK / 8][4], dp[NK / 8][4];
        wg_fence();
#pragma unroll
        for (int k = 0; k < HD / 16; ++k) {
            ss80<0, 0>(s, desc<0>(qt, HD, k), desc<0>(k_s, HD, k), k);
            ss80<0, 0>(dp, desc<0>(dot, HD, k), desc<0>(v_s, HD, k), k);
        }
        wg_commit();
        wg_wait();
        pin<NK / 8>(s);
        pin<NK / 8>(dp);
        unsigned pa[NK / 16][4], da[NK / 16][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows g and g + 8 of the warp's 16
            float mx = -__int_as_float(0x7f800000);
#pragma unroll
            for (int n = 0; n < NK / 8; ++n)
#pragma unroll
                for (int j = 2 * h; j < 2 * h + 2; ++j) {
                    s[n][j] = 8 * n + 2 * t + (j & 1) < n_text ? s[n][j] * s_factor : -__int_as_float(0x7f800000);
                    mx = fmaxf(mx, s[n][j]);
                }
            mx = quad_max(mx);
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < NK / 8; ++n)
#pragma unroll
                for (int j = 2 * h; j < 2 * h + 2; ++j) sum += (s[n][j] = exp2f(s[n][j] - mx));
            const float inv = 1.f / quad_sum(sum);
            float dot_row = 0.f;
#pragma unroll
            for (int n = 0; n < NK / 8; ++n)
#pragma unroll
                for (int j = 2 * h; j < 2 * h + 2; ++j) dot_row += (s[n][j] *= inv) * dp[n][j];
            const float d_row = quad_sum(dot_row);  // times s_do s_v
#pragma unroll
            for (int n = 0; n < NK / 8; ++n)
#pragma unroll
                for (int j = 2 * h; j < 2 * h + 2; ++j) dp[n][j] = s[n][j] * (dp[n][j] - d_row) * dp_factor;
        }
        // P and dS as fp16 A operands (the accumulators' layout is the A fragments'), and into
        // shared memory for the products over the rows.
        const int r = 16 * warp + g;
#pragma unroll
        for (int n = 0; n < NK / 8; ++n) {
            const unsigned p0 = pack(s[n][0], s[n][1]), p1 = pack(s[n][2], s[n][3]);
            const unsigned d0 = pack(dp[n][0], dp[n][1]), d1 = pack(dp[n][2], dp[n][3]);
            pa[n / 2][2 * (n % 2)] = p0, pa[n / 2][2 * (n % 2) + 1] = p1;
            da[n / 2][2 * (n % 2)] = d0, da[n / 2][2 * (n % 2) + 1] = d1;
            *reinterpret_cast<unsigned*>(p_s + cm(r, 8 * n + 2 * t, NK)) = p0;
            *reinterpret_cast<unsigned*>(p_s + cm(r + 8, 8 * n + 2 * t, NK)) = p1;
            *reinterpret_cast<unsigned*>(ds_s + cm(r, 8 * n + 2 * t, NK)) = d0;
            *reinterpret_cast<unsigned*>(ds_s + cm(r + 8, 8 * n + 2 * t, NK)) = d1;
        }
        fence_async();
        __syncthreads();  // every row of P and dS is stored
        float oa[HD / 8][4], dqa[HD / 8][4];
        pin<NK / 8>(dk);
        pin<NK / 8>(dv);
        wg_fence();
#pragma unroll
        for (int k = 0; k < NK / 16; ++k) {
            rs64<1>(oa, pa[k], desc<1>(v_s, HD, k), k);
            rs64<1>(dqa, da[k], desc<1>(k_s, HD, k), k);
        }
#pragma unroll
        for (int k = 0; k < BQ / 16; ++k) {
            ss80<1, 1>(dv, desc<1>(dot, HD, k), desc<1>(p_s, NK, k), 1);
            ss80<1, 1>(dk, desc<1>(qt, HD, k), desc<1>(ds_s, NK, k), 1);
        }
        wg_commit();
        wg_wait();
        pin<HD / 8>(oa);
        pin<HD / 8>(dqa);
        pin<NK / 8>(dk);
        pin<NK / 8>(dv);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + r + 8 * h;
            if (row < n_video) {
                float* orow = o + ((long long)b * n_video + row) * hidden + col;
                float* dqrow = dq + ((long long)b * n_video + row) * hidden + col;
#pragma unroll
                for (int n = 0; n < HD / 8; ++n) {
                    *reinterpret_cast<float2*>(orow + 8 * n + 2 * t) =
                        make_float2(oa[n][2 * h] / s_v, oa[n][2 * h + 1] / s_v);
                    *reinterpret_cast<float2*>(dqrow + 8 * n + 2 * t) =
                        make_float2(dqa[n][2 * h] / s_k, dqa[n][2 * h + 1] / s_k);
                }
            }
        }
    }
#if INPUTS
    const float s_q_final = s_q_run, s_do_final = s_do_run;
#else
    const float s_q_final = 1.f, s_do_final = 1.f;
#endif
    // dK^T and dV^T: warp w holds head-dim rows 16w + g (+ 8), keys 8j + 2t (+ 1).
    float* part = dkv_part + ((long long)blockIdx.x * gridDim.z + b) * n_text * 2 * hidden + col;
#pragma unroll
    for (int j = 0; j < NK / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = 8 * j + 2 * t + (i & 1), dim = 16 * warp + g + 8 * (i >> 1);
            if (key < n_text) {
                part[(long long)key * 2 * hidden + dim] = dk[j][i] / s_q_final;
                part[(long long)key * 2 * hidden + hidden + dim] = dv[j][i] / s_do_final;
            }
        }
}

// Q and dO (z < B: Q of sample z, else dO of sample z - B) into fp16 tiles of 64 rows x one head at
// power-of-two scales from each tile's largest |value| (scales [2][B][H][tiles]).
extern "C" __global__ void __launch_bounds__(THREADS)
to_half_tiles(const float* __restrict__ q, const float* __restrict__ dout, half_t* __restrict__ q_h,
              half_t* __restrict__ do_h, float* __restrict__ scales, int n_video, int batch, int hidden) {
    __shared__ float red[THREADS / 32];
    const int which = blockIdx.z / batch, b = blockIdx.z % batch, col = blockIdx.y * HD, row0 = blockIdx.x * BQ;
    const long long base = ((long long)b * n_video) * hidden + col;
    const float* x = (which ? dout : q) + base;
    half_t* y = (which ? do_h : q_h) + base;
    constexpr int PER_THREAD = BQ * HD / 8 / THREADS;
    float4 v[PER_THREAD][2];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int chunk = threadIdx.x + THREADS * i, row = row0 + chunk / (HD / 8), c = 8 * (chunk % (HD / 8));
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        v[i][0] = row < n_video ? *reinterpret_cast<const float4*>(x + (long long)row * hidden + c) : zero;
        v[i][1] = row < n_video ? *reinterpret_cast<const float4*>(x + (long long)row * hidden + c + 4) : zero;
        amax = fmaxf(amax, fmaxf(fmaxf(fmaxf(fabsf(v[i][0].x), fabsf(v[i][0].y)), fmaxf(fabsf(v[i][0].z), fabsf(v[i][0].w))),
                                 fmaxf(fmaxf(fabsf(v[i][1].x), fabsf(v[i][1].y)), fmaxf(fabsf(v[i][1].z), fabsf(v[i][1].w)))));
    }
    const float s = pow2_scale(block_max(amax, red));
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int chunk = threadIdx.x + THREADS * i, row = row0 + chunk / (HD / 8), c = 8 * (chunk % (HD / 8));
        if (row < n_video)
            *reinterpret_cast<uint4*>(y + (long long)row * hidden + c) =
                make_uint4(pack(v[i][0].x * s, v[i][0].y * s), pack(v[i][0].z * s, v[i][0].w * s),
                           pack(v[i][1].x * s, v[i][1].y * s), pack(v[i][1].z * s, v[i][1].w * s));
    }
    if (threadIdx.x == 0) scales[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = s;
}
""".replace("WGMMA_SOURCE", _wgmma_source()).replace("QUAD_REDUCTIONS", _split.QUAD_REDUCTIONS)
# K, V, P, dS (fp16); Q and dO, two tiles of each (fp16 inputs) or one and an fp32 staging of each
SMEM = {0: 2 * (2 * 80 * 64 + 4 * 64 * 64 + 2 * 64 * 80), 1: 2 * (2 * 80 * 64 + 2 * 64 * 64 + 2 * 64 * 80) + 4 * 2 * 64 * 64}
SMEM[2] = SMEM[0]


def main():
    import cupy
    from cupy_xattn import kernels
    from cupy_xattn.attention_bwd import AttentionBackward, launch_layout
    from cupy_xattn.checks import Problem

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    lean_kernels = {}
    for inputs in (0, 1, 2):
        module = kernels.load_cubin(kernels.compile_source(f"#define INPUTS {inputs}\n" + SOURCE, "lean_attn", "sm_90a"),
                                    "lean_attn")
        lean_kernels[inputs] = module.get_function("lean_attn")
        lean_kernels[inputs].max_dynamic_shared_size_bytes = SMEM[inputs]
    to_half_tiles = module.get_function("to_half_tiles")
    heads, scale, sms = 16, 0.125, cupy.cuda.Device().attributes["MultiProcessorCount"]
    d = heads * 64
    for shape in args.shapes:
        b, nv, nt = (int(x) for x in shape.split("x"))
        problem = Problem(b, nv, nt, d, heads, 64, scale)
        layout = launch_layout(problem, "tf32", sms)
        rng = cupy.random.default_rng(0)
        q, dout = (rng.standard_normal((b * nv, d), dtype=numpy.float32) for _ in range(2))
        kv = rng.standard_normal((b * nt, 2 * d), dtype=numpy.float32)
        halves = [x.astype(numpy.float16) for x in (q, kv, dout)]
        o, dq = (cupy.full((b * nv, d), numpy.nan, numpy.float32) for _ in range(2))
        chunks, tiles = layout.n_chunks, layout.tiles_per_chunk
        parts = cupy.full((chunks, b * nt, 2 * d), numpy.nan, numpy.float32)
        cells = []
        n_tiles = -(-nv // 64)
        q_h, do_h = cupy.empty((b * nv, d), numpy.float16), cupy.empty((b * nv, d), numpy.float16)
        tile_scales = cupy.empty((2, b, heads, n_tiles), numpy.float32)
        for form, inputs in ((0, halves), (1, (q, kv, dout)), (2, (q_h, kv, do_h))):
            kernel = lean_kernels[form]
            want = _split.reference(*(x.astype(numpy.float32) for x in (halves if form == 0 else (q, kv, dout))),
                                   b, nv, nt, heads, scale)

            def lean():
                if form == 2:
                    to_half_tiles((n_tiles, heads, 2 * b), (128,), (q, dout, q_h, do_h, tile_scales, numpy.int32(nv),
                                                                     numpy.int32(b), numpy.int32(d)))
                kernel((chunks, heads, b), (128,), (*inputs, o, dq, parts, numpy.int32(nv), numpy.int32(nt),
                                                     numpy.int32(d), numpy.int32(tiles), numpy.float32(scale),
                                                     tile_scales),
                       shared_mem=SMEM[form])
            lean()
            got = (o, dq, parts.sum(0))
            errors = [float(cupy.abs(x - y).max() / cupy.abs(y).max()) for x, y in zip(got, want)]
            inputs_name = ("fp16", "fp32", "fp32 through a per-tile fp16 conversion")[form]
            cells.append(f"lean, {inputs_name} inputs {_split.graph_time(lean, args.reps):.1f} us "
                         f"({kernel.num_regs} registers; max rel. errors O, dQ, dK|dV "
                         + ", ".join(f"{e:.1e}" for e in errors) + ")")
        library = AttentionBackward(problem, "tf32", sms)
        zeros = cupy.zeros(d, numpy.float32)
        biases = cupy.array([zeros.data.ptr] * 3, numpy.uint64)
        o2, dq2 = cupy.empty_like(o), cupy.empty_like(dq)
        dkv2 = cupy.empty((b * nt, 2 * d), numpy.float32)
        t_library = _split.graph_time(lambda: library(q, kv, biases.data.ptr, dout, o2, dq2, dkv2), args.reps)
        print(f"{shape} ({chunks} chunks of {tiles} tiles): " + " | ".join(cells)
              + f" | library tf32 {layout.name} {t_library:.1f} us (with its partials' sum) | graph replays, warm L2, "
              f"medians of {args.reps}", flush=True)


if __name__ == "__main__":
    main()
