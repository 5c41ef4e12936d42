"""Q0 and dO of the fp16 mode as one cublasGemmGroupedBatchedEx call, against the two
cublasGemmBatchedEx calls the plan makes (one stream, and two streams side by side as its lanes).

Q0 = X Wq^T ("tn") and dO = dY Wo ("nn"), D = 1024, M = B·Nv rows, fp16 operands and outputs,
fp32 accumulation, both at the constant alpha the lean attention takes: a batched call needs one
trans pair, a grouped one takes one a group. cuBLAS's documentation of the grouped call: alphas
and betas in host memory only (CUBLAS_STATUS_NOT_SUPPORTED in device pointer mode, the plan's
mode for the fp16 scales: fine here, the alpha is a constant), and with fp16 A and B only an fp16
C (so not the weight gradients' fp32 outputs). Prints whether the grouped call matches the two
calls and replays in a CUDA graph, and the GPU times.

Usage (GPU): PYTHONPATH=. python3 scripts/grouped_probe.py [M ...]      (default 512 1024 2048 8192)
Times: CUDA events around 10 queued calls behind a spin kernel, median of 20 (gemm_probe.py's
median_us); L2 not flushed.
"""
import ctypes
import sys

import cupy
import numpy

from cupy_xattn import _cublas, gemm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemm_probe import median_us  # noqa: E402

D = 1024
_int_p = ctypes.POINTER(ctypes.c_int)
POINTER_MODE_HOST = 0


def grouped_function():
    """cublasGemmGroupedBatchedEx (cuBLAS ≥ 12.5) on the library CuPy loaded, or None."""
    lib = _cublas._library()
    fn = getattr(lib, "cublasGemmGroupedBatchedEx", None)
    if fn is not None:
        v = ctypes.c_void_p
        fn.argtypes = [v, _int_p, _int_p, _int_p, _int_p, _int_p, v, v, ctypes.c_int, _int_p, v, ctypes.c_int,
                       _int_p, v, v, ctypes.c_int, _int_p, ctypes.c_int, _int_p, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def ints(values):
    return (ctypes.c_int * len(values))(*values)


def pointers(*arrays):
    return cupy.array([a.data.ptr for a in arrays], numpy.uint64)


class Pair:
    """Two column-major fp16 products C_i = alpha op(A_i) op(B_i), each m × n × k, as cuBLAS takes them."""

    def __init__(self, trans, m, n, k, ld, a, b, c, alpha):
        self.trans, self.m, self.n, self.k, self.ld, self.c = trans, m, n, k, ld, c
        self.dev_alpha = cupy.array([alpha], numpy.float32)
        self.zero = cupy.zeros(1, numpy.float32)
        self.tables = [(pointers(a_i), pointers(b_i), pointers(c_i)) for a_i, b_i, c_i in zip(a, b, c)]
        self.grouped_tables = pointers(*a), pointers(*b), pointers(*c)
        self.host_scalars = (ctypes.c_float * 2)(alpha, alpha), (ctypes.c_float * 2)(0.0, 0.0)

    def one(self, handle, i):
        a, b, c = self.tables[i]
        handle.gemm_batched(*self.trans[i], self.m, self.n, self.k, self.dev_alpha.data.ptr, a.data.ptr,
                            gemm.R_16F, self.ld, b.data.ptr, gemm.R_16F, self.ld, self.zero.data.ptr, c.data.ptr,
                            gemm.R_16F, self.ld, 1, gemm.COMPUTE_32F)

    def grouped(self, fn, handle):
        """cuBLAS status of one grouped call (two groups of one product) on ``handle``'s stream."""
        lib, h = handle._lib, handle._handle
        lib.cublasSetPointerMode_v2(h, POINTER_MODE_HOST)  # the grouped call's scalars are host arrays
        alpha, beta = (ctypes.cast(x, ctypes.c_void_p) for x in self.host_scalars)
        a, b, c = self.grouped_tables
        two = lambda x: ints([x, x])  # noqa: E731
        status = fn(h, ints([t[0] for t in self.trans]), ints([t[1] for t in self.trans]), two(self.m),
                    two(self.n), two(self.k), alpha, ctypes.c_void_p(a.data.ptr), gemm.R_16F, two(self.ld),
                    ctypes.c_void_p(b.data.ptr), gemm.R_16F, two(self.ld), beta, ctypes.c_void_p(c.data.ptr),
                    gemm.R_16F, two(self.ld), 2, ints([1, 1]), gemm.COMPUTE_32F)
        lib.cublasSetPointerMode_v2(h, _cublas.POINTER_MODE_DEVICE)
        return status


def q0_dout(m):
    rng = cupy.random.default_rng(m)
    half = lambda *shape: (rng.standard_normal(shape, dtype=numpy.float32) * 0.5).astype(numpy.float16)  # noqa: E731
    x, dy, wq, wo = half(m, D), half(m, D), half(D, D), half(D, D)
    # Row-major C = A B is column-major C^T = B^T A^T: the second factor's buffer comes first.
    return Pair([(gemm.OP_T, gemm.OP_N), (gemm.OP_N, gemm.OP_N)], D, m, D, D, [wq, wo], [x, dy],
                [cupy.empty((m, D), numpy.float16) for _ in range(2)], 2.0 ** -10)


def main():
    fn = grouped_function()
    if fn is None:
        print("this libcublas has no cublasGemmGroupedBatchedEx")
        return
    s0, s1 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    h0, h1 = _cublas.Handle(s0), _cublas.Handle(s1)
    print("Q0 | dO, fp16:  M   one stream  two streams   grouped   max|grouped − two calls|  in a graph")
    for m in [int(v) for v in sys.argv[1:]] or [512, 1024, 2048, 8192]:
        pair = q0_dout(m)
        with s0:
            pair.one(h0, 0)
            pair.one(h0, 1)
            separate = [c.astype(numpy.float32) for c in pair.c]
            for c in pair.c:
                c.fill(numpy.nan)
            status = pair.grouped(fn, h0)
            diff = max(float(cupy.abs(c.astype(numpy.float32) - r).max()) for c, r in zip(pair.c, separate))
            graph = "-"
            if status == 0:
                try:
                    s0.begin_capture()
                    pair.grouped(fn, h0)
                    g = s0.end_capture()
                    for c in pair.c:
                        c.fill(numpy.nan)
                    g.launch(s0)
                    s0.synchronize()
                    same = all(bool((c.astype(numpy.float32) == r).all()) for c, r in zip(pair.c, separate))
                    graph = "replays, same" if same else "replays, DIFFERS"
                except Exception as exc:  # noqa: BLE001 - a probe reports what failed
                    graph = f"fails: {exc}"

            def one_stream():
                pair.one(h0, 0)
                pair.one(h0, 1)

            def two_streams():
                s1.wait_event(s0.record())
                pair.one(h0, 0)
                pair.one(h1, 1)
                s0.wait_event(s1.record())

            times = [median_us(one_stream), median_us(two_streams)]
            grouped = f"{median_us(lambda: pair.grouped(fn, h0)):8.1f} µs" if status == 0 else f"status {status}"
        print(f"{m:18d}  " + "  ".join(f"{t:8.1f} µs" for t in times) + f"  {grouped:>11}  {diff:12.3g}  {graph}")


if __name__ == "__main__":
    main()
