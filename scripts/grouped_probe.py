"""Two fp16 products of the backward as one cublasGemmGroupedBatchedEx call, against the two
cublasGemmBatchedEx calls the plan makes (one stream, and two streams side by side as its lanes).

Pairs (D = 1024, M = B·Nv rows, fp16 operands, fp32 accumulation, fp16 or fp32 output as the fp16
mode writes them):
  q0|dout: Q0 = X Wq^T ("tn") and dO = dY Wo ("nn"): the lean attention's inputs, both at the
           constant alpha kv_half_alpha; a batched call needs one trans pair, a grouped one does not.
  dwo|dwq: dWo = dY^T O and dWq = dQ^T X (both "nt"), at different alphas (the copies' scales):
           a batched call needs one alpha, a grouped one takes one a group.
For each: whether the grouped call is accepted with alphas in device memory (the plan's pointer
mode: the fp16 scales come from kernels) and in host memory, whether it matches the two calls
(max |difference|), whether it runs inside a CUDA graph capture, and the GPU times.

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
    """Two column-major products C_i = alpha_i op(A_i) op(B_i), each m × n × k, as cuBLAS takes them."""

    def __init__(self, name, trans, m, n, k, ld, a, b, c, alphas):
        self.name, self.trans, self.m, self.n, self.k, self.ld = name, trans, m, n, k, ld
        self.a, self.b, self.c, self.alphas = a, b, c, alphas
        self.c_type = gemm.R_16F if c[0].dtype == numpy.float16 else gemm.R_32F
        self.dev_alphas = cupy.array(alphas, numpy.float32)
        self.zero = cupy.zeros(len(alphas), numpy.float32)
        self.tables = [(pointers(a_i), pointers(b_i), pointers(c_i)) for a_i, b_i, c_i in zip(a, b, c)]
        self.grouped_tables = pointers(*a), pointers(*b), pointers(*c)

    def one(self, handle, i):
        a, b, c = self.tables[i]
        handle.gemm_batched(*self.trans[i], self.m, self.n, self.k, self.dev_alphas.data.ptr + 4 * i, a.data.ptr,
                            gemm.R_16F, self.ld, b.data.ptr, gemm.R_16F, self.ld, self.zero.data.ptr, c.data.ptr,
                            self.c_type, self.ld, 1, gemm.COMPUTE_32F)

    def grouped(self, fn, handle, device_alphas):
        """Status of one grouped call (two groups of one product) on ``handle``'s stream."""
        lib, h = handle._lib, handle._handle
        lib.cublasSetPointerMode_v2(h, _cublas.POINTER_MODE_DEVICE if device_alphas else POINTER_MODE_HOST)
        if device_alphas:
            alpha, beta = ctypes.c_void_p(self.dev_alphas.data.ptr), ctypes.c_void_p(self.zero.data.ptr)
        else:
            self._host = (ctypes.c_float * 2)(*self.alphas), (ctypes.c_float * 2)(0.0, 0.0)
            alpha, beta = (ctypes.cast(x, ctypes.c_void_p) for x in self._host)
        a, b, c = self.grouped_tables
        two = lambda x: ints([x, x])  # noqa: E731
        status = fn(h, ints([t[0] for t in self.trans]), ints([t[1] for t in self.trans]), two(self.m),
                    two(self.n), two(self.k), alpha, ctypes.c_void_p(a.data.ptr), gemm.R_16F, two(self.ld),
                    ctypes.c_void_p(b.data.ptr), gemm.R_16F, two(self.ld), beta, ctypes.c_void_p(c.data.ptr),
                    self.c_type, two(self.ld), 2, ints([1, 1]), gemm.COMPUTE_32F)
        lib.cublasSetPointerMode_v2(h, _cublas.POINTER_MODE_DEVICE)
        return status


def pairs(m):
    rng = cupy.random.default_rng(m)
    half = lambda *shape: (rng.standard_normal(shape, dtype=numpy.float32) * 0.5).astype(numpy.float16)  # noqa: E731
    x, dy, o, dq = (half(m, D) for _ in range(4))
    wq, wo = half(D, D), half(D, D)
    # Row-major C = A B is column-major C^T = B^T A^T: the second factor's buffer comes first.
    q0_dout = Pair("q0|dout", [(gemm.OP_T, gemm.OP_N), (gemm.OP_N, gemm.OP_N)], D, m, D, D,
                   [wq, wo], [x, dy], [cupy.empty((m, D), numpy.float16) for _ in range(2)], [2.0 ** -10] * 2)
    dwo_dwq = Pair("dwo|dwq", [(gemm.OP_N, gemm.OP_T)] * 2, D, D, m, D,
                   [o, x], [dy, dq], [cupy.empty((D, D), numpy.float32) for _ in range(2)], [2.0 ** -12, 2.0 ** -9])
    return q0_dout, dwo_dwq


def main():
    fn = grouped_function()
    if fn is None:
        print("this libcublas has no cublasGemmGroupedBatchedEx")
        return
    s0, s1 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    h0, h1 = _cublas.Handle(s0), _cublas.Handle(s1)
    print("pair      M     one stream  two streams  grouped(device α)  grouped(host α)   max|grouped − two calls|  in a graph")
    for m in [int(v) for v in sys.argv[1:]] or [512, 1024, 2048, 8192]:
        for pair in pairs(m):
            with s0:
                pair.one(h0, 0)
                pair.one(h0, 1)
                separate = [c.astype(numpy.float32) for c in pair.c]
                for c in pair.c:
                    c.fill(numpy.nan)
                statuses = {mode: pair.grouped(fn, h0, mode) for mode in (True, False)}
                diff = max(float(cupy.abs(c.astype(numpy.float32) - r).max()) for c, r in zip(pair.c, separate))
                graph = "-"
                device_ok = statuses[True] == 0
                if device_ok or statuses[False] == 0:
                    try:
                        s0.begin_capture()
                        pair.grouped(fn, h0, device_ok)
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
                for mode in (True, False):
                    times.append(median_us(lambda: pair.grouped(fn, h0, mode)) if statuses[mode] == 0 else None)
            cells = [f"{t:8.1f} µs" for t in times[:2]] + [
                f"{t:8.1f} µs" if t is not None else f"status {statuses[mode]}"
                for t, mode in zip(times[2:], (True, False))]
            print(f"{pair.name}  {m:5d}  " + "  ".join(f"{c:>14}" for c in cells) + f"  {diff:12.3g}  {graph}")


if __name__ == "__main__":
    main()
