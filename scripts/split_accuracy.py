"""How accurate are split products (3xFP16, the fp32 mode's; 3xTF32), and where does their error come from?

Usage (GPU): PYTHONPATH=. python3 scripts/split_accuracy.py [K ...]     (default 1024 8192)

For C = A B^T with A [512, K], B [1024, K] drawn randn, the max relative error against a
float64 product of the float32 inputs (max|C − C64| / max|C64|) of: cuBLAS FFMA; one TF32 GEMM;
3xTF32 (hi = x rounded to TF32, lo = x − hi, three TF32 GEMMs lo·hi + hi·lo + hi·hi); 3xFP16 as
the backward's fp32 mode does it (half_scaling.cu's scaled fp16 copies and remainders, three fp16
GEMMs); and 3xFP16 with its hi·hi product accumulated in 2, 4, 8 K-chunks whose sums cuBLAS adds
with beta = 1 (fp32 adds outside the tensor cores). If the error falls with the chunk length, it
comes from the tensor cores' fp32 accumulation, not from the splitting.
"""
import sys

import cupy
import numpy

from cupy_xattn import gemm
from cupy_xattn.half_scaling import HalfScaler


def tf32_pair(x):
    """(hi, lo): x rounded to TF32 (to nearest, ties away, on the magnitude's bits) and the rest."""
    bits = x.view(numpy.uint32)
    hi = ((bits + numpy.uint32(0x1000)) & numpy.uint32(0xFFFFE000)).view(numpy.float32)
    return hi, x - hi


def three_tf32(a, b):
    (a_hi, a_lo), (b_hi, b_lo) = tf32_pair(a), tf32_pair(b)
    c = cupy.empty((a.shape[0], b.shape[0]), numpy.float32)
    tf32 = dict(trans_b=True, compute=gemm.COMPUTE_32F_FAST_TF32)
    gemm.matmul(a_lo, b_hi, c, **tf32)
    gemm.matmul(a_hi, b_lo, c, accumulate=True, **tf32)
    return gemm.matmul(a_hi, b_hi, c, accumulate=True, **tf32)


def three_fp16(a, b, chunks=1):
    """The fp32 mode's product: fp16 copies and remainders of a and b at power-of-two scales."""
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    scaler = HalfScaler(2, sm_count)
    sources = cupy.array([a.data.ptr, b.data.ptr], numpy.uint64)
    halves = [(cupy.empty(x.shape, numpy.float16), cupy.empty(x.shape, numpy.float16)) for x in (a, b)]
    copy, rescale = scaler.group(sources.data.ptr, [(x.size, hi.data.ptr, i, lo.data.ptr, 0, 0)
                                                    for i, (x, (hi, lo)) in enumerate(zip((a, b), halves))])
    copy(), rescale()
    alpha = numpy.array([numpy.prod(scaler.inverse_scales().get())], numpy.float32)  # exact: powers of two
    (a_hi, a_lo), (b_hi, b_lo) = halves
    c = cupy.empty((a.shape[0], b.shape[0]), numpy.float32)
    fp16 = dict(trans_b=True, compute=gemm.COMPUTE_32F, alpha=alpha)
    gemm.matmul(a_lo, b_hi, c, **fp16)
    gemm.matmul(a_hi, b_lo, c, accumulate=True, **fp16)
    step = max(1, a.shape[1] // chunks)
    for k in range(0, a.shape[1], step):
        gemm.matmul(a_hi[:, k:k + step], b_hi[:, k:k + step], c, accumulate=True, **fp16)
    return c


def main():
    rng = numpy.random.default_rng(0)
    print("K      FFMA     TF32     3xTF32   3xFP16   3xFP16, hi·hi in 2 / 4 / 8 chunks")
    for k in [int(x) for x in sys.argv[1:]] or [1024, 8192]:
        a = cupy.asarray(rng.standard_normal((512, k), dtype=numpy.float32))
        b = cupy.asarray(rng.standard_normal((1024, k), dtype=numpy.float32))
        ref = a.get().astype(numpy.float64) @ b.get().astype(numpy.float64).T
        error = lambda c: float(numpy.abs(c.get() - ref).max() / numpy.abs(ref).max())  # noqa: E731
        c = cupy.empty((512, 1024), numpy.float32)
        ffma = error(gemm.matmul(a, b, c, trans_b=True, compute=gemm.COMPUTE_32F))
        tf32 = error(gemm.matmul(a, b, c, trans_b=True, compute=gemm.COMPUTE_32F_FAST_TF32))
        split = [error(three_fp16(a, b, chunks)) for chunks in (1, 2, 4, 8)]
        print(f"{k:<6d} {ffma:.1e}  {tf32:.1e}  {error(three_tf32(a, b)):.1e}  {split[0]:.1e}  "
              + " / ".join(f"{e:.1e}" for e in split[1:]))


if __name__ == "__main__":
    main()
