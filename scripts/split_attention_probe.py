"""A prototype of the streamed cases' attention backward as two kernels (perf-notes, Session 20):
a forward pass over (query tile, head, batch) blocks for O, each row's log-sum-exp and
D = rowsum(dO ∘ O), then a backward pass over (key tile, head, batch) blocks that keep their K, V
tile and dK, dV accumulators and loop over the query tiles, adding dQ by fp32 atomics.

Plain fp16 operands (a cast, no scales), no biases, text lengths or fp16 O: only to time the
structure against attn_bwd (the library's streamed kernel; its time in the plan's graph:
`graph_kernels.py SHAPE fp16 --trace --kernels`) and check it against a float32 CuPy reference of
the same math. Each line: the forward kernel alone, then with the backward kernel (and dQ's
memset); then both again on fp16 copies of Q, K|V and dO (INPUT_HALF: tiles copied by cp.async,
the next one while the present one is used; otherwise fp32 loads converted as they are stored).

Measured on the H200 (perf-notes, Session 20), against attn_bwd's 38.5, 63.0 and 154.1 µs: with
fp32 loads as fast (38.8, 63.8, 154.0 µs at 8e5850e), not the 2–2.5× the shorter chains
predicted; with fp16 inputs 29.8, 63.6 and 117.0 µs (at 8923047); errors fp16-level (≤ 1.3e-3
of each output's max). Since then, not re-timed: the forward-alone line no longer includes dQ's
memset (the recorded figures do), and product_from_registers took the two register-operand
products out of the kernels (nvcc 13 builds the same INPUT_HALF cubin from both, and for fp32
inputs one of the same size and registers with 222 bytes in another order).

Usage: PYTHONPATH=. python3 scripts/split_attention_probe.py [--reps 50] 2x256x211 4x256x293 8x256x373
"""
import argparse

import numpy

# The max and sum over a quad's four lanes (the lanes of one accumulator row); lean_attention_probe's too.
QUAD_REDUCTIONS = r"""
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}
"""

SOURCE = r"""
#define HD 64          // head_dim
#define TILE 64        // query rows or keys per tile
#define LD 72          // shared-memory row stride in halves (odd number of 16-byte units)
#define THREADS 128    // four warps of 16 rows (or keys)

#define INF __int_as_float(0x7f800000)
typedef unsigned short half_t;  // fp16 bits (no cuda_fp16.h: NVRTC without toolkit headers)

// fp16 of lo in the low half (first in memory), of hi in the high half.
__device__ __forceinline__ unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void mma16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void ldsm4(unsigned r[4], const half_t* p) {
    unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm4_t(unsigned r[4], const half_t* p) {
    unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// A fragments (16 x 16) of a row-major [m][k] tile at (m0, k0).
__device__ __forceinline__ void load_a(unsigned a[4], const half_t* s, int m0, int k0, int lane) {
    ldsm4(a, s + (m0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + k0 + 8 * (lane >> 4));
}
// A fragments (16 x 16) of A(m, k) = T[k][m], T row-major, at (m0, k0).
__device__ __forceinline__ void load_a_t(unsigned a[4], const half_t* s, int m0, int k0, int lane) {
    ldsm4_t(a, s + (k0 + (lane & 7) + 8 * (lane >> 4)) * LD + m0 + 8 * ((lane >> 3) & 1));
}
// B fragments of two n tiles (n0, n0 + 8), k0..k0+15, of B(k, n) = T[n][k]: b[0..1] tile n0, b[2..3] n0 + 8.
__device__ __forceinline__ void load_b_nk(unsigned b[4], const half_t* s, int n0, int k0, int lane) {
    ldsm4(b, s + (n0 + (lane & 7) + 8 * (lane >> 4)) * LD + k0 + 8 * ((lane >> 3) & 1));
}
// ... of B(k, n) = T[k][n].
__device__ __forceinline__ void load_b_kn(unsigned b[4], const half_t* s, int n0, int k0, int lane) {
    ldsm4_t(b, s + (k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + n0 + 8 * (lane >> 4));
}
// rows [row0, row0 + 64) of a [rows][ld] fp32 matrix, columns col0..col0+63, to fp16 shared memory; zeros past n.
__device__ __forceinline__ void load_tile(half_t* s, const float* g, long long ld, int row0, int n, int col0) {
    for (int f = threadIdx.x; f < TILE * HD / 4; f += THREADS) {
        int r = f / (HD / 4), c = 4 * (f % (HD / 4));
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (row0 + r < n) v = *reinterpret_cast<const float4*>(g + (long long)(row0 + r) * ld + col0 + c);
        *reinterpret_cast<uint2*>(s + r * LD + c) = make_uint2(pack(v.x, v.y), pack(v.z, v.w));
    }
}
#ifndef INPUT_HALF
#define INPUT_HALF 0  // 1: Q, K|V and dO arrive as fp16 and are copied into the tiles by cp.async
#endif
#if INPUT_HALF
typedef half_t in_t;
#else
typedef float in_t;
#endif
// A tile (load_tile's rows and columns) into shared memory: fp32 loaded and converted, or fp16
// copied by cp.async (16 bytes a copy, zeros past n), which the caller commits and waits for.
__device__ __forceinline__ void fetch_tile(half_t* s, const in_t* g, long long ld, int row0, int n, int col0) {
#if INPUT_HALF
    for (int f = threadIdx.x; f < TILE * HD / 8; f += THREADS) {
        const int r = f / (HD / 8), c = 8 * (f % (HD / 8));
        const bool in = row0 + r < n;
        const half_t* src = in ? g + (long long)(row0 + r) * ld + col0 + c : g;
        const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(s + r * LD + c));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(in ? 16 : 0));
    }
#else
    load_tile(s, g, ld, row0, n, col0);
#endif
}
__device__ __forceinline__ void commit_and_wait_all() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// acc[16 × 64] += X · T for a warp: X [16 × 64] in mma accumulator fragments (P or dS, rounded
// to fp16 as A fragments: an m16n8 accumulator pair is an m16k16 A fragment), T [64][64] in shared memory.
__device__ __forceinline__ void product_from_registers(float acc[8][4], const float x[8][4], const half_t* t_s,
                                                       int lane) {
    for (int kk = 0; kk < 4; ++kk) {
        const unsigned a[4] = {pack(x[2 * kk][0], x[2 * kk][1]), pack(x[2 * kk][2], x[2 * kk][3]),
                               pack(x[2 * kk + 1][0], x[2 * kk + 1][1]), pack(x[2 * kk + 1][2], x[2 * kk + 1][3])};
        for (int j = 0; j < 8; j += 2) {
            unsigned bf[4];
            load_b_kn(bf, t_s, 8 * j, 16 * kk, lane);
            mma16816(acc[j], a, bf);
            mma16816(acc[j + 1], a, bf + 2);
        }
    }
}
QUAD_REDUCTIONS

// Grid (query tiles, H, B). q, dout, o: [B·Nv][D]; kv: [B·Nt][2D]; lse (log2 domain), drow: [B][H][Nv].
extern "C" __global__ void __launch_bounds__(THREADS) split_fwd(
        const in_t* q, const in_t* kv, const float* dout, float* o, float* lse, float* drow,
        int nv, int nt, int heads, float scale_log2) {
    // INPUT_HALF: K and V double-buffered, the next tile copied while this one is used
    __shared__ __align__(16) half_t q_s[TILE * LD], kv_s[1 + INPUT_HALF][2][TILE * LD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, row0 = blockIdx.x * TILE, D = heads * HD;
    const in_t* kvb = kv + (long long)b * nt * 2 * D;
    fetch_tile(q_s, q + (long long)b * nv * D, D, row0, nv, h * HD);
    if (INPUT_HALF) {
        fetch_tile(kv_s[0][0], kvb, 2 * D, 0, nt, h * HD);
        fetch_tile(kv_s[0][1], kvb, 2 * D, 0, nt, D + h * HD);
    }
    unsigned qa[4][4];
    float acc[8][4] = {}, m[2] = {-INF, -INF}, l[2] = {0.f, 0.f};
    for (int key0 = 0; key0 < nt; key0 += TILE) {
        const int buf = INPUT_HALF ? (key0 / TILE) & 1 : 0;
        half_t *k_s = kv_s[buf][0], *v_s = kv_s[buf][1];
        if (INPUT_HALF) {
            commit_and_wait_all();
            __syncthreads();  // this tile is in; every thread is done with the other buffer
            if (key0 + TILE < nt) {
                fetch_tile(kv_s[buf ^ 1][0], kvb, 2 * D, key0 + TILE, nt, h * HD);
                fetch_tile(kv_s[buf ^ 1][1], kvb, 2 * D, key0 + TILE, nt, D + h * HD);
            }
            commit();
        } else {
            __syncthreads();  // the previous tile's K and V are read
            fetch_tile(k_s, kvb, 2 * D, key0, nt, h * HD);
            fetch_tile(v_s, kvb, 2 * D, key0, nt, D + h * HD);
            __syncthreads();
        }
        if (key0 == 0)
            for (int kk = 0; kk < 4; ++kk) load_a(qa[kk], q_s, 16 * warp, 16 * kk, lane);
        float s[8][4] = {};
        for (int kk = 0; kk < 4; ++kk)
            for (int j = 0; j < 8; j += 2) {
                unsigned bf[4];
                load_b_nk(bf, k_s, 8 * j, 16 * kk, lane);
                mma16816(s[j], qa[kk], bf);
                mma16816(s[j + 1], qa[kk], bf + 2);
            }
        float mx[2] = {m[0], m[1]};
        for (int j = 0; j < 8; ++j)
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + 8 * j + 2 * t + (e & 1);
                s[j][e] = key < nt ? s[j][e] * scale_log2 : -INF;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
            }
        for (int r = 0; r < 2; ++r) {
            mx[r] = quad_max(mx[r]);
            const float alpha = exp2f(m[r] - mx[r]);
            l[r] *= alpha;
            for (int j = 0; j < 8; ++j) { acc[j][2 * r] *= alpha; acc[j][2 * r + 1] *= alpha; }
            m[r] = mx[r];
        }
        for (int j = 0; j < 8; ++j)
            for (int e = 0; e < 4; ++e) { s[j][e] = exp2f(s[j][e] - m[e >> 1]); l[e >> 1] += s[j][e]; }
        product_from_registers(acc, s, v_s, lane);  // O += P V
    }
    for (int r = 0; r < 2; ++r) {
        l[r] = quad_sum(l[r]);
        const int row = row0 + 16 * warp + g + 8 * r;
        float d = 0.f;
        for (int j = 0; j < 8; ++j) {
            const float o0 = acc[j][2 * r] / l[r], o1 = acc[j][2 * r + 1] / l[r];
            if (row < nv) {
                const long long at = ((long long)b * nv + row) * D + h * HD + 8 * j + 2 * t;
                *reinterpret_cast<float2*>(o + at) = make_float2(o0, o1);
                const float2 dy = *reinterpret_cast<const float2*>(dout + at);
                d += o0 * dy.x + o1 * dy.y;
            }
        }
        d = quad_sum(d);
        if (row < nv && t == 0) {
            const long long at = ((long long)b * heads + h) * nv + row;
            lse[at] = m[r] + log2f(l[r]);
            drow[at] = d;
        }
    }
}

// Grid (key tiles, H, B). dq: [B·Nv][D], zeroed before (atomics); dkv: [B·Nt][2D].
extern "C" __global__ void __launch_bounds__(THREADS) split_bwd(
        const in_t* q, const in_t* kv, const in_t* dout, const float* lse, const float* drow,
        float* dq, float* dkv, int nv, int nt, int heads, float scale, float scale_log2) {
    // (6 + 2·INPUT_HALF) operand tiles: K, V, P, dS, then Q and dO (INPUT_HALF: two of each)
    extern __shared__ __align__(16) half_t smem[];
    half_t *k_s = smem, *v_s = k_s + TILE * LD, *p_s = v_s + TILE * LD, *ds_s = p_s + TILE * LD;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, key0 = blockIdx.x * TILE, D = heads * HD;
    const in_t* kvb = kv + (long long)b * nt * 2 * D;
    fetch_tile(k_s, kvb, 2 * D, key0, nt, h * HD);
    fetch_tile(v_s, kvb, 2 * D, key0, nt, D + h * HD);
    float dk[8][4] = {}, dv[8][4] = {};
    const in_t *qb = q + (long long)b * nv * D, *dob = dout + (long long)b * nv * D;
    if (INPUT_HALF) {
        fetch_tile(ds_s + TILE * LD, qb, D, 0, nv, h * HD);
        fetch_tile(ds_s + 2 * TILE * LD, dob, D, 0, nv, h * HD);
    }
    for (int row0 = 0; row0 < nv; row0 += TILE) {
        const int buf = INPUT_HALF ? (row0 / TILE) & 1 : 0;
        half_t *q_s = ds_s + (1 + 2 * buf) * TILE * LD, *do_s = q_s + TILE * LD;
        if (INPUT_HALF) {
            commit_and_wait_all();
            __syncthreads();  // this tile is in; every thread is done with the other buffers, P and dS
            if (row0 + TILE < nv) {
                fetch_tile(q_s + (buf ? -2 : 2) * TILE * LD, qb, D, row0 + TILE, nv, h * HD);
                fetch_tile(do_s + (buf ? -2 : 2) * TILE * LD, dob, D, row0 + TILE, nv, h * HD);
            }
            commit();
        } else {
            __syncthreads();  // the previous tile's operands are read
            fetch_tile(q_s, qb, D, row0, nv, h * HD);
            fetch_tile(do_s, dob, D, row0, nv, h * HD);
            __syncthreads();
        }
        float s[8][4] = {}, dp[8][4] = {};
        for (int kk = 0; kk < 4; ++kk) {
            unsigned qa[4], da[4];
            load_a(qa, q_s, 16 * warp, 16 * kk, lane);
            load_a(da, do_s, 16 * warp, 16 * kk, lane);
            for (int j = 0; j < 8; j += 2) {
                unsigned bk[4], bv[4];
                load_b_nk(bk, k_s, 8 * j, 16 * kk, lane);
                load_b_nk(bv, v_s, 8 * j, 16 * kk, lane);
                mma16816(s[j], qa, bk);
                mma16816(s[j + 1], qa, bk + 2);
                mma16816(dp[j], da, bv);
                mma16816(dp[j + 1], da, bv + 2);
            }
        }
        const int r0 = 16 * warp + g;
        float lse_r[2], d_r[2];
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + r0 + 8 * r;
            const long long at = ((long long)b * heads + h) * nv + row;
            lse_r[r] = row < nv ? lse[at] : INF;
            d_r[r] = row < nv ? drow[at] : 0.f;
        }
        for (int j = 0; j < 8; ++j)
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + 8 * j + 2 * t + (e & 1);
                s[j][e] = key < nt ? exp2f(s[j][e] * scale_log2 - lse_r[e >> 1]) : 0.f;  // P
                dp[j][e] = s[j][e] * (dp[j][e] - d_r[e >> 1]);                           // dS / scale
            }
        for (int j = 0; j < 8; ++j)
            for (int r = 0; r < 2; ++r) {
                *reinterpret_cast<unsigned*>(p_s + (r0 + 8 * r) * LD + 8 * j + 2 * t) = pack(s[j][2 * r], s[j][2 * r + 1]);
                *reinterpret_cast<unsigned*>(ds_s + (r0 + 8 * r) * LD + 8 * j + 2 * t) = pack(dp[j][2 * r], dp[j][2 * r + 1]);
            }
        float dqa[8][4] = {};
        product_from_registers(dqa, dp, k_s, lane);  // dQ / scale = dS K
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + r0 + 8 * r;
            if (row < nv)
                for (int j = 0; j < 8; ++j) {
                    float* p = dq + ((long long)b * nv + row) * D + h * HD + 8 * j + 2 * t;
                    atomicAdd(p, dqa[j][2 * r] * scale);
                    atomicAdd(p + 1, dqa[j][2 * r + 1] * scale);
                }
        }
        __syncthreads();  // P and dS of all rows
        for (int kk = 0; kk < 4; ++kk) {  // over the tile's query rows
            unsigned pa[4], sa[4];
            load_a_t(pa, p_s, 16 * warp, 16 * kk, lane);
            load_a_t(sa, ds_s, 16 * warp, 16 * kk, lane);
            for (int j = 0; j < 8; j += 2) {
                unsigned bo[4], bq[4];
                load_b_kn(bo, do_s, 8 * j, 16 * kk, lane);
                load_b_kn(bq, q_s, 8 * j, 16 * kk, lane);
                mma16816(dv[j], pa, bo);
                mma16816(dv[j + 1], pa, bo + 2);
                mma16816(dk[j], sa, bq);
                mma16816(dk[j + 1], sa, bq + 2);
            }
        }
    }
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + 16 * warp + g + 8 * r;
        if (key < nt)
            for (int j = 0; j < 8; ++j) {
                float* p = dkv + ((long long)b * nt + key) * 2 * D + h * HD + 8 * j + 2 * t;
                *reinterpret_cast<float2*>(p) = make_float2(dk[j][2 * r] * scale, dk[j][2 * r + 1] * scale);
                *reinterpret_cast<float2*>(p + D) = make_float2(dv[j][2 * r], dv[j][2 * r + 1]);
            }
    }
}
""".replace("QUAD_REDUCTIONS", QUAD_REDUCTIONS)


def reference(q, kv, dout, b, nv, nt, heads, scale):
    """float32 CuPy: O, dQ, [dK | dV] of the same math, heads batched."""
    import cupy
    d = heads * 64
    split = lambda x, n: x.reshape(b, n, heads, 64).transpose(0, 2, 1, 3)  # noqa: E731
    Q, dO = split(q, nv), split(dout, nv)
    K, V = split(kv[:, :d], nt), split(kv[:, d:], nt)
    S = scale * Q @ K.transpose(0, 1, 3, 2)
    P = cupy.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    O = P @ V
    dP = dO @ V.transpose(0, 1, 3, 2)
    dS = P * (dP - (dO * O).sum(-1, keepdims=True))
    merge = lambda x, n: x.transpose(0, 2, 1, 3).reshape(b * n, d)  # noqa: E731
    dkv = cupy.concatenate([merge(scale * dS.transpose(0, 1, 3, 2) @ Q, nt), merge(P.transpose(0, 1, 3, 2) @ dO, nt)], 1)
    return merge(O, nv), merge(scale * dS @ K, nv), dkv


def graph_time(run, reps):
    """µs a replay of a CUDA graph of ``run`` (no host time in it): the median of ``reps`` rounds of
    ten replays; lean_attention_probe's too."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run()
        stream.begin_capture()
        run()
        graph = stream.end_capture()
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(10):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / 10)
    return float(numpy.median(times))


def main():
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    modules = [cupy.RawModule(code=SOURCE, options=("-std=c++17", "--use_fast_math", f"-DINPUT_HALF={half}"))
               for half in (0, 1)]
    heads, scale = 16, 0.125
    d = heads * 64
    for shape in args.shapes:
        b, nv, nt = (int(x) for x in shape.split("x"))
        rng = cupy.random.default_rng(0)
        q, dout = (rng.standard_normal((b * nv, d), dtype=numpy.float32) for _ in range(2))
        kv = rng.standard_normal((b * nt, 2 * d), dtype=numpy.float32)
        want = reference(q, kv, dout, b, nv, nt, heads, scale)
        lse, drow = cupy.empty((b, heads, nv), numpy.float32), cupy.empty((b, heads, nv), numpy.float32)
        n, f = numpy.int32, numpy.float32
        row = [shape]
        for label, half, backward in (("fwd", 0, False), ("fwd + bwd", 0, True), ("fp16 inputs: fwd", 1, False),
                                      ("fwd + bwd", 1, True)):
            fwd = modules[half].get_function("split_fwd")
            operands = (q, kv, dout) if not half else (q.astype(numpy.float16), kv.astype(numpy.float16),
                                                       dout.astype(numpy.float16))
            o, dq = cupy.full((b * nv, d), numpy.nan, numpy.float32), cupy.empty((b * nv, d), numpy.float32)
            dkv = cupy.full((b * nt, 2 * d), numpy.nan, numpy.float32)
            bwd = modules[half].get_function("split_bwd") if backward else None
            bwd_smem = (6 + 2 * half) * 64 * 72 * 2  # operand tiles (INPUT_HALF: Q and dO twice)
            if bwd:
                bwd.max_dynamic_shared_size_bytes = bwd_smem

            def run():
                if bwd:
                    dq.fill(0)  # the backward adds into dQ
                fwd((-(-nv // 64), heads, b), (128,), operands[:2] + (dout, o, lse, drow, n(nv), n(nt), n(heads),
                                                                      f(scale * numpy.log2(numpy.e))))
                if bwd:
                    bwd((-(-nt // 64), heads, b), (128,), operands + (lse, drow, dq, dkv, n(nv), n(nt), n(heads),
                                                                      f(scale), f(scale * numpy.log2(numpy.e))),
                        shared_mem=bwd_smem)
            run()
            outputs = (o, dq, dkv) if bwd else (o,)
            errors = [float(cupy.abs(got - ref).max() / cupy.abs(ref).max()) for got, ref in zip(outputs, want)]
            regs = f"{fwd.num_regs}" + (f" + {bwd.num_regs}" if bwd else "")
            row.append(f"{label} {graph_time(run, args.reps):.1f} us (max rel. errors "
                       + ", ".join(f"{e:.1e}" for e in errors) + f"; {regs} registers)")
        print(" | ".join(row) + f" | graph replays, warm L2, medians of {args.reps}")

if __name__ == "__main__":
    main()
