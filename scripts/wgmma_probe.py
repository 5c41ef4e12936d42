"""Does our reading of sm_90a's wgmma hold? One warpgroup, one 64×N tile, both operands from shared
memory in the no-swizzle layout, checked against NumPy for each operand order and each reading of
the descriptor's two strides. The groundwork for an attention on wgmma (docs/perf-notes.md, Next).

Every operand is a row-major fp16 tensor [rows][cols] stored in 8×8 "core matrices" (8 rows of 16
bytes, 128 contiguous bytes), core matrix (i, j) at byte i·(cols/8)·128 + j·128. Such a tensor is
"K-major" when its columns run along K (A = M×K, B = N×K: the layout of Q, K, V, dO, P, dS as the
attention stores them) and is read transposed (imm-trans 1) when its rows run along K. The PTX
manual: the leading-dimension byte offset (LBO) is the distance between core matrices adjacent in
K, the stride-dimension byte offset (SBO) between those adjacent in M or N; each reading of that is
tried for the transposed orders, where the manual's wording has been read both ways.

Usage (H200): PYTHONPATH=. python3 scripts/wgmma_probe.py [--swapped]      prints one line per trial
              PYTHONPATH=. python3 scripts/wgmma_probe.py --bench          TFLOP/s of back-to-back wgmmas
"""
import itertools
import sys

import numpy

from cupy_xattn import kernels

M = 64


def kernel_source(n):
    """The probe kernel for a 64×n tile (n a multiple of 8, ≤ 256)."""
    regs = n // 2  # fp32 accumulators per thread: 64·n / 128
    outs = ", ".join(f"%{i}" for i in range(regs))
    binds = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    source = r"""
#define M_ROWS 64
// Descriptor: start address >> 4 in bits 0-13, LBO >> 4 in 16-29, SBO >> 4 in 32-45, no swizzle.
__device__ __forceinline__ unsigned long long desc(const void* smem, unsigned lbo, unsigned sbo) {
    const unsigned long long address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    return ((address & 0x3ffff) >> 4) | (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(sbo >> 4) << 32);
}

// [rows][cols] fp16 into core matrices (see the script's docstring).
__device__ __forceinline__ void to_core_matrices(unsigned short* dst, const unsigned short* src, int rows, int cols) {
    for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) {
        const int r = i / cols, c = i % cols;
        dst[(r / 8) * (cols / 8) * 64 + (c / 8) * 64 + (r % 8) * 8 + c % 8] = src[i];
    }
}

template <int TA, int TB>
__device__ void probe(const unsigned short* a, int a_rows, int a_cols, const unsigned short* b, int b_rows,
                      int b_cols, float* c, int k_total, const unsigned* strides) {
    extern __shared__ unsigned short smem[];
    unsigned short* a_s = smem;
    unsigned short* b_s = smem + a_rows * a_cols;
    to_core_matrices(a_s, a, a_rows, a_cols);
    to_core_matrices(b_s, b, b_rows, b_cols);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic-proxy stores, then wgmma reads
    __syncthreads();
    float d[@REGS@];
    for (int i = 0; i < @REGS@; ++i) d[i] = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    for (int k = 0; k < k_total; k += 16) {
        // strides: LBO, SBO and the byte step per 16 of K, for A then for B
        const unsigned long long da = desc(reinterpret_cast<const char*>(a_s) + (k / 16) * strides[2], strides[0],
                                           strides[1]);
        const unsigned long long db = desc(reinterpret_cast<const char*>(b_s) + (k / 16) * strides[5], strides[3],
                                           strides[4]);
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n@N@k16.f32.f16.f16 {@OUTS@}, %@RA@, %@RB@, p, 1, 1, %@TA@, %@TB@;\n}\n"
                     : @BINDS@
                     : "l"(da), "l"(db), "n"(TA), "n"(TB));
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    // Accumulator layout: warp w rows 16w + lane/4 (+ 8), columns 8j + 2·(lane % 4) (+ 1).
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int j = 0; j < @N@ / 8; ++j)
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * warp + lane / 4 + 8 * h, col = 8 * j + 2 * (lane % 4);
            c[row * @N@ + col] = d[4 * j + 2 * h];
            c[row * @N@ + col + 1] = d[4 * j + 2 * h + 1];
        }
}

// Throughput: `reps` times the tile's k loop on the same shared-memory operands (K-major both),
// one commit and wait per pass, as an attention would per product.
extern "C" __global__ void __launch_bounds__(128) bench(float* c, int k_total, int reps, const unsigned* strides) {
    extern __shared__ unsigned short smem[];
    for (int i = threadIdx.x; i < (M_ROWS + @N@) * k_total; i += blockDim.x) smem[i] = 0x3c00 ^ (i & 0x8000);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const unsigned short* b_s = smem + M_ROWS * k_total;
    float d[@REGS@];
    for (int i = 0; i < @REGS@; ++i) d[i] = 0.f;
    for (int r = 0; r < reps; ++r) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll 1
        for (int k = 0; k < k_total; k += 16) {
            const unsigned long long da = desc(reinterpret_cast<const char*>(smem) + (k / 16) * strides[2],
                                               strides[0], strides[1]);
            const unsigned long long db = desc(reinterpret_cast<const char*>(b_s) + (k / 16) * strides[5],
                                               strides[3], strides[4]);
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n@N@k16.f32.f16.f16 {@OUTS@}, %@RA@, %@RB@, p, 1, 1, 0, 0;\n}\n"
                         : @BINDS@
                         : "l"(da), "l"(db));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    float sum = 0.f;
    for (int i = 0; i < @REGS@; ++i) sum += d[i];
    c[blockIdx.x * blockDim.x + threadIdx.x] = sum;  // keeps the products
}

#define PROBE(TA, TB) \
    extern "C" __global__ void __launch_bounds__(128) probe_##TA##TB( \
        const unsigned short* a, int a_rows, int a_cols, const unsigned short* b, int b_rows, int b_cols, float* c, \
        int k_total, const unsigned* strides) { \
        probe<TA, TB>(a, a_rows, a_cols, b, b_rows, b_cols, c, k_total, strides); \
    }
PROBE(0, 0)
PROBE(0, 1)
PROBE(1, 0)
PROBE(1, 1)
"""
    for key, value in dict(REGS=regs, N=n, OUTS=outs, BINDS=binds, RA=regs, RB=regs + 1, TA=regs + 2,
                           TB=regs + 3).items():
        source = source.replace(f"@{key}@", str(value))
    return source


def load_module(n):
    """The probe's kernels for a 64×n tile, compiled for sm_90a and loaded."""
    return kernels.load_cubin(kernels.compile_source(kernel_source(n), "wgmma_probe.cu", "sm_90a"), "wgmma_probe")


def strides_for(rows, cols, transposed, swap):
    """(LBO, SBO, byte step per 16 of K) of a [rows][cols] tensor in core matrices: K along its
    columns (K-major) or, transposed, along its rows; swap tries the other reading of LBO/SBO."""
    along_cols, along_rows = 128, (cols // 8) * 128
    k_adjacent, mn_adjacent = (along_rows, along_cols) if transposed else (along_cols, along_rows)
    lbo, sbo = (mn_adjacent, k_adjacent) if swap else (k_adjacent, mn_adjacent)
    return lbo, sbo, 2 * k_adjacent


def main():
    import cupy

    swapped = "--swapped" in sys.argv[1:]  # also the other reading (on the H200 it faulted: illegal address)

    rng = numpy.random.default_rng(0)
    for n, k_total in ((80, 64), (64, 80)):
        module = load_module(n)
        a_math = rng.standard_normal((M, k_total)).astype(numpy.float16)
        b_math = rng.standard_normal((n, k_total)).astype(numpy.float16)
        expected = a_math.astype(numpy.float32) @ b_math.astype(numpy.float32).T
        swaps = (False, True) if swapped else (False,)
        for ta, tb, swap_a, swap_b in itertools.product((0, 1), (0, 1), swaps, swaps):
            if (swap_a and not ta) or (swap_b and not tb):
                continue  # K-major: the manual's reading only
            a = numpy.ascontiguousarray(a_math.T if ta else a_math)
            b = numpy.ascontiguousarray(b_math.T if tb else b_math)
            strides = strides_for(*a.shape, ta, swap_a) + strides_for(*b.shape, tb, swap_b)
            c = cupy.full((M, n), numpy.nan, numpy.float32)
            kernel = module.get_function(f"probe_{ta}{tb}")
            kernel((1,), (128,), (cupy.asarray(a.view(numpy.uint16)), numpy.int32(a.shape[0]), numpy.int32(a.shape[1]),
                                  cupy.asarray(b.view(numpy.uint16)), numpy.int32(b.shape[0]), numpy.int32(b.shape[1]),
                                  c, numpy.int32(k_total), cupy.asarray(numpy.array(strides, numpy.uint32))),
                   shared_mem=2 * (a.size + b.size))
            got = cupy.asnumpy(c)
            error = float(numpy.nanmax(numpy.abs(got - expected))) if numpy.isfinite(got).any() else float("nan")
            print(f"m64n{n}k16 K={k_total} trans_a={ta} trans_b={tb} swapped lbo/sbo a={swap_a} b={swap_b} "
                  f"strides={strides}: max|error| {error:.3g}, finite {numpy.isfinite(got).mean():.2f}",
                  flush=True)


def bench():
    """TFLOP/s of back-to-back m64nNk16 wgmmas on resident operands, 1 to 4 warpgroups per SM."""
    import cupy

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    for n, k_total in ((80, 64), (64, 80)):
        module = load_module(n)
        kernel = module.get_function("bench")
        strides = cupy.asarray(numpy.array(strides_for(M, k_total, 0, False) + strides_for(n, k_total, 0, False),
                                           numpy.uint32))
        reps = 2000
        for per_sm in (1, 2, 3, 4):
            blocks = per_sm * sms
            c = cupy.empty(blocks * 128, numpy.float32)
            args = ((blocks,), (128,), (c, numpy.int32(k_total), numpy.int32(reps), strides))
            kernel(*args, shared_mem=2 * (M + n) * k_total)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            kernel(*args, shared_mem=2 * (M + n) * k_total)
            end.record()
            end.synchronize()
            seconds = cupy.cuda.get_elapsed_time(start, end) / 1e3
            tflops = 2 * M * n * k_total * reps * blocks / seconds / 1e12
            print(f"bench m64n{n}k16, K={k_total} per pass, {per_sm} warpgroup(s) per SM: {tflops:.0f} TFLOP/s "
                  f"({seconds * 1e6:.0f} µs)", flush=True)


if __name__ == "__main__":
    bench() if "--bench" in sys.argv[1:] else main()
