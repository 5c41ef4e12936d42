"""How accurate is the fp32 mode's 3xTF32 product, and where does its error come from?

Usage (GPU): PYTHONPATH=. python3 scripts/split_accuracy.py [K ...]     (default 1024 8192)

For C = A B^T with A [512, K], B [1024, K] drawn randn, the max relative error against a
float64 product (max|C − C64| / max|C64|) of: cuBLAS FFMA; one TF32 GEMM; the three TF32 GEMMs
of the backward's fp32 mode over tf32_split.cu's (hi, lo) pairs; and the same with the hi·hi
product accumulated in K-chunks whose sums cuBLAS adds with beta = 1 (in fp32, outside the
tensor cores). If the error falls with the chunk length, it comes from the tensor cores' fp32
accumulation, not from the splitting.
"""
import sys

import cupy
import numpy

from cupy_xattn import gemm
from cupy_xattn.tf32_split import Tf32Split


def pair(x):
    """(hi, lo) of a float32 CuPy array, by the library's kernel."""
    hi, lo = cupy.empty_like(x), cupy.empty_like(x)
    sources = cupy.array([x.data.ptr], numpy.uint64)
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    Tf32Split(sources.data.ptr, [(x.size, hi.data.ptr, lo.data.ptr)], sm_count)()
    return hi, lo


def three_tf32(a, b, chunks=1, own_hi=False):
    """The fp32 mode's product; ``own_hi``: the fp32 operands stand in for their hi copies
    (equal only if cuBLAS reads fp32 as TF32 the way tf32_split.cu rounds)."""
    (a_hi, a_lo), (b_hi, b_lo) = pair(a), pair(b)
    if own_hi:
        a_hi, b_hi = a, b
    c = cupy.empty((a.shape[0], b.shape[0]), numpy.float32)
    tf32 = dict(trans_b=True, compute=gemm.COMPUTE_32F_FAST_TF32)
    gemm.matmul(a_lo, b_hi, c, **tf32)
    gemm.matmul(a_hi, b_lo, c, accumulate=True, **tf32)
    step = max(1, a.shape[1] // chunks)
    for k in range(0, a.shape[1], step):
        gemm.matmul(a_hi[:, k:k + step], b_hi[:, k:k + step], c, accumulate=True, **tf32)
    return c


def main():
    rng = numpy.random.default_rng(0)
    print("K      FFMA     TF32     3xTF32   (operands as hi)  3xTF32, hi·hi in 2 / 4 / 8 chunks")
    for k in [int(x) for x in sys.argv[1:]] or [1024, 8192]:
        a64, b64 = rng.standard_normal((512, k)), rng.standard_normal((1024, k))
        a, b = cupy.asarray(a64, numpy.float32), cupy.asarray(b64, numpy.float32)
        ref = (a.get().astype(numpy.float64) @ b.get().astype(numpy.float64).T)  # of the float32 inputs
        error = lambda c: float(numpy.abs(c.get() - ref).max() / numpy.abs(ref).max())  # noqa: E731
        c = cupy.empty((512, 1024), numpy.float32)
        ffma = error(gemm.matmul(a, b, c, trans_b=True, compute=gemm.COMPUTE_32F))
        tf32 = error(gemm.matmul(a, b, c, trans_b=True, compute=gemm.COMPUTE_32F_FAST_TF32))
        split = [error(three_tf32(a, b, chunks)) for chunks in (1, 2, 4, 8)]
        own_hi = error(three_tf32(a, b, own_hi=True))
        print(f"{k:<6d} {ffma:.1e}  {tf32:.1e}  {split[0]:.1e}   {own_hi:.1e}           "
              + " / ".join(f"{e:.1e}" for e in split[1:]))


if __name__ == "__main__":
    main()
