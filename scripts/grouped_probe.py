"""Q0 and dO of the fp16 mode as one cublasGemmGroupedBatchedEx call, against the two
cublasGemmBatchedEx calls the plan makes (one stream, and two streams side by side as its lanes).

Q0 = X Wq^T ("tn") and dO = dY Wo ("nn"), D = 1024, M = B·Nv rows, fp16 operands and outputs,
fp32 accumulation, both at the constant alpha the lean attention takes: a batched call needs one
trans pair, a grouped one takes one a group. cuBLAS's documentation of the grouped call: alphas
and betas in host memory only (CUBLAS_STATUS_NOT_SUPPORTED in device pointer mode, the plan's
mode for the fp16 scales: fine here, the alpha is a constant), and with fp16 A and B only an fp16
C (so not the weight gradients' fp32 outputs). Prints whether the grouped call matches the two
calls, whether its graph replay matches its eager run, and the GPU times of the three as graph
replays (the plan replays a graph).

Usage (GPU): PYTHONPATH=. python3 scripts/grouped_probe.py [M ...]      (default 512 1024 2048 8192)
Times: CUDA events around 10 queued calls behind a spin kernel, median of 20 (gemm_probe.py's
median_us); L2 not flushed.
"""
import ctypes
import math
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
        a, b, c = (pointers(*x) for x in (a, b, c))
        two = lambda x: ints([x, x])  # noqa: E731
        # The grouped call's arguments, made once (its scalars and per-group arrays are host memory).
        self._host = (ints([t[0] for t in trans]), ints([t[1] for t in trans]), two(m), two(n), two(k),
                      (ctypes.c_float * 2)(alpha, alpha), two(ld), two(ld), (ctypes.c_float * 2)(0.0, 0.0),
                      two(ld), ints([1, 1]))
        self._tables = a, b, c

    def one(self, handle, i):
        a, b, c = self.tables[i]
        handle.gemm_batched(*self.trans[i], self.m, self.n, self.k, self.dev_alpha.data.ptr, a.data.ptr,
                            gemm.R_16F, self.ld, b.data.ptr, gemm.R_16F, self.ld, self.zero.data.ptr, c.data.ptr,
                            gemm.R_16F, self.ld, 1, gemm.COMPUTE_32F)

    def grouped(self, fn, handle):
        """cuBLAS status of one grouped call (two groups of one product) on ``handle``'s stream."""
        lib, h = handle._lib, handle._handle
        ta, tb, m, n, k, alpha, lda, ldb, beta, ldc, sizes = self._host
        a, b, c = self._tables
        _cublas._check(lib.cublasSetPointerMode_v2(h, POINTER_MODE_HOST), "cublasSetPointerMode")
        try:  # the grouped call's scalars are host arrays
            return fn(h, ta, tb, m, n, k, ctypes.cast(alpha, ctypes.c_void_p), ctypes.c_void_p(a.data.ptr),
                      gemm.R_16F, lda, ctypes.c_void_p(b.data.ptr), gemm.R_16F, ldb, ctypes.cast(beta, ctypes.c_void_p),
                      ctypes.c_void_p(c.data.ptr), gemm.R_16F, ldc, 2, sizes, gemm.COMPUTE_32F)
        finally:
            _cublas._check(lib.cublasSetPointerMode_v2(h, _cublas.POINTER_MODE_DEVICE), "cublasSetPointerMode")


def q0_dout(m):
    rng = cupy.random.default_rng(m)
    half = lambda *shape: (rng.standard_normal(shape, dtype=numpy.float32) * 0.5).astype(numpy.float16)  # noqa: E731
    x, dy, wq, wo = half(m, D), half(m, D), half(D, D), half(D, D)
    # Row-major C = A B is column-major C^T = B^T A^T: the second factor's buffer comes first.
    return Pair([(gemm.OP_T, gemm.OP_N), (gemm.OP_N, gemm.OP_N)], D, m, D, D, [wq, wo], [x, dy],
                [cupy.empty((m, D), numpy.float16) for _ in range(2)], 2.0 ** -10)


def captured(stream, issue):
    """A CUDA graph of what ``issue`` launches on ``stream`` (and the streams it forks)."""
    issue()  # cuBLAS loads its kernels outside the capture
    cupy.cuda.Device().synchronize()
    stream.begin_capture()
    try:
        issue()
    finally:
        graph = stream.end_capture()
    return graph


def largest_difference(outputs, references):
    """max |x − y| over the pairs; NaN where an output holds a NaN (left unwritten: poisoned)."""
    return max(float(cupy.abs(x.astype(numpy.float32) - y.astype(numpy.float32)).max())
               if bool(cupy.isfinite(x).all()) else math.nan for x, y in zip(outputs, references))


def main():
    fn = grouped_function()
    if fn is None:
        print("this libcublas has no cublasGemmGroupedBatchedEx")
        return
    s0, s1 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    h0, h1 = _cublas.Handle(s0), _cublas.Handle(s1)
    forked, joined = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)
    widths = (6, 12, 12, 12, 12, 12, 0)
    header = ("M", "one stream", "two streams", "grouped", "vs two calls", "replay diff", "  (graph replays, µs)")
    print("Q0 | dO, fp16: " + " ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for m in [int(v) for v in sys.argv[1:]] or [512, 1024, 2048, 8192]:
        pair = q0_dout(m)
        cupy.cuda.Device().synchronize()  # the operands and tables, made on the default stream, are written
        with s0:
            pair.one(h0, 0)
            pair.one(h0, 1)
            separate = [c.copy() for c in pair.c]
            for c in pair.c:
                c.fill(numpy.nan)
            status = pair.grouped(fn, h0)
            diff = largest_difference(pair.c, separate) if status == 0 else math.nan
            eager, replay_diff = [c.copy() for c in pair.c], math.nan

            def one_stream():
                pair.one(h0, 0)
                pair.one(h0, 1)

            def two_streams():
                forked.record(s0)
                s1.wait_event(forked)
                pair.one(h0, 0)
                pair.one(h1, 1)
                joined.record(s1)
                s0.wait_event(joined)

            statuses = []
            graphs = [captured(s0, one_stream), captured(s0, two_streams)]
            if status == 0:  # the two graphs above rewrote the outputs: the grouped call's are in eager
                graphs.append(captured(s0, lambda: statuses.append(pair.grouped(fn, h0))))
                for c in pair.c:
                    c.fill(numpy.nan)
                graphs[-1].launch(s0)
                replay_diff = largest_difference(pair.c, eager)
            times = [median_us(lambda g=g: g.launch(s0)) for g in graphs]
        cells = [f"{t:9.1f} µs" for t in times] + [f"status {status}"] * (status != 0)
        if any(statuses):
            cells[-1] += f" (statuses, eager then captured: {statuses})"
        print(f"{'':15}{m:>6} " + " ".join(f"{c:>12}" for c in cells) + f" {diff:12.3g} {replay_diff:12.3g}")


if __name__ == "__main__":
    main()
