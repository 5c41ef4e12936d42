"""Would cuBLASLt, with the algorithm chosen by timing, run the weight gradients faster than cuBLAS?

dW = A^T B with A, B [M, D] row-major (M = B·Nv or B·Nt, D = 1024), as the backward computes dWo,
dWq ("nt": both operands read along M, their slow dimension) and, for comparison, over K-major
copies A^T, B^T ("tn"); each as one product and as a strided batch of two (the backward batches
dWo with dWq and dWk with dWv). For each: cuBLAS's own choice, strided (``gemm.matmul_batched``)
and with pointer arrays (``cublasGemmBatchedEx``, as the backward calls it: the choice differs),
cuBLASLt's first heuristic, and the fastest of up to 32 heuristic candidates (algorithm id,
tile id, split-K).

Usage (GPU): PYTHONPATH=. python3 scripts/lt_probe.py [M ...]     (default 8192 4928)
Times as scripts/gemm_probe.py: 10 queued calls behind a spin kernel, median of 20, warm L2.
"""
import ctypes
import sys

import cupy
import numpy

from cupy_xattn import _cublas, gemm
from gemm_probe import median_us

R_32F, R_16F, COMPUTE_32F, COMPUTE_TF32, OP_N, OP_T = (gemm.R_32F, gemm.R_16F, gemm.COMPUTE_32F,
                                                    gemm.COMPUTE_32F_FAST_TF32, gemm.OP_N, gemm.OP_T)
DESC_TRANSA, DESC_TRANSB = 3, 4
LAYOUT_BATCH_COUNT, LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK_NUM = 0, 1, 2
WORKSPACE = 32 << 20


# libcublasLt as CuPy mapped it, its functions bound, and the library's helpers for it
LT, HeuristicResult, set_attr, check = _cublas.lt_library(), _cublas.LtHeuristic, _cublas.lt_set, _cublas._check
_p = ctypes.c_void_p


def layout(dtype, rows, cols, ld, batch, stride):
    handle = _p()
    check(LT.cublasLtMatrixLayoutCreate(ctypes.byref(handle), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                        ctypes.c_int64(ld)), "layout")
    if batch > 1:
        set_attr(LT.cublasLtMatrixLayoutSetAttribute, handle, LAYOUT_BATCH_COUNT, batch, ctypes.c_int32)
        set_attr(LT.cublasLtMatrixLayoutSetAttribute, handle, LAYOUT_STRIDED_BATCH_OFFSET, stride, ctypes.c_int64)
    return handle


class LtProduct:
    """Row-major C[b] = A[b]^T B[b] ("nt": a, b are [batch, M, D]) or C[b] = A_t[b] B_t[b]^T
    ("tn": a, b are the K-major copies [batch, D, M]), through cublasLtMatmul, column-major:
    C^T = B^T A is D x D with K = M."""

    def __init__(self, handle, a, b, c, kind, compute):
        self.handle, self.a, self.b, self.c = handle, a, b, c
        batch, m = a.shape[0], (a.shape[1] if kind == "nt" else a.shape[2])
        d = c.shape[-1]
        dtype = R_16F if a.dtype == numpy.float16 else R_32F
        self.desc = _p()
        check(LT.cublasLtMatmulDescCreate(ctypes.byref(self.desc), compute, R_32F), "desc")
        trans_a, trans_b = (OP_N, OP_T) if kind == "nt" else (OP_T, OP_N)
        set_attr(LT.cublasLtMatmulDescSetAttribute, self.desc, DESC_TRANSA, trans_a, ctypes.c_int32)
        set_attr(LT.cublasLtMatmulDescSetAttribute, self.desc, DESC_TRANSB, trans_b, ctypes.c_int32)
        stored = (d, m, d) if kind == "nt" else (m, d, m)  # rows, cols, ld of each operand as stored
        self.a_layout = layout(dtype, *stored, batch, m * d)  # cuBLASLt's A is our b, its B our a
        self.b_layout = layout(dtype, *stored, batch, m * d)
        self.c_layout = layout(R_32F, d, d, d, batch, d * d)
        self.workspace = cupy.empty(WORKSPACE, numpy.uint8)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def candidates(self, n=32):
        pref = _p()
        check(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        set_attr(LT.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE_BYTES, WORKSPACE, ctypes.c_uint64)
        results, count = (HeuristicResult * n)(), ctypes.c_int(0)
        check(LT.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a_layout, self.b_layout, self.c_layout,
                                                self.c_layout, pref, n, results, ctypes.byref(count)), "heuristic")
        return [(i, r) for i, r in enumerate(results[:count.value]) if r.state == 0]  # (heuristic rank, result)

    def run(self, result):
        check(LT.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), _p(self.b.data.ptr), self.a_layout,
                                _p(self.a.data.ptr), self.b_layout, ctypes.byref(self.beta), _p(self.c.data.ptr),
                                self.c_layout, _p(self.c.data.ptr), self.c_layout, ctypes.byref(result.algo),
                                _p(self.workspace.data.ptr), ctypes.c_size_t(WORKSPACE),
                                _p(cupy.cuda.get_current_stream().ptr)), "matmul")


def pointer_arrays(handle, a, b, c, kind, compute):
    """``cublasGemmBatchedEx`` of the same product, pointers from a device array (as in backward.py)."""
    batch, m = a.shape[0], (a.shape[1] if kind == "nt" else a.shape[2])
    d = c.shape[-1]
    dtype = R_16F if a.dtype == numpy.float16 else R_32F
    table = cupy.array([x[i].data.ptr for x in (b, a, c) for i in range(batch)], numpy.uint64)
    constants = cupy.array([0.0, 1.0], numpy.float32)  # beta, alpha (device pointer mode)
    ops, ld = ((OP_N, OP_T), d) if kind == "nt" else ((OP_T, OP_N), m)
    base = table.data.ptr

    def run():
        handle.gemm_batched(*ops, d, d, m, constants.data.ptr + 4, base, dtype, ld, base + 8 * batch, dtype, ld,
                            constants.data.ptr, base + 16 * batch, R_32F, d, batch, compute)
    run.keep = (table, constants)
    return run


def describe(result):
    values = []
    for attr in (CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK_NUM):
        v = ctypes.c_int32(0)
        check(LT.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(result.algo), attr, ctypes.byref(v), 4, None),
              "algo attribute")
        values.append(v.value)
    return "algo {} tile {} split-K {} waves {:.2f}".format(*values, result.waves)


def main():
    handle = _cublas.lt_handle()
    cublas_handle = _cublas.Handle(cupy.cuda.get_current_stream())
    d = 1024
    rng = cupy.random.default_rng(0)
    for m in [int(x) for x in sys.argv[1:]] or [8192, 4928]:
        for dtype, compute, name in ((numpy.float32, COMPUTE_TF32, "tf32"), (numpy.float16, COMPUTE_32F, "fp16")):
            a, b = (rng.standard_normal((2, m, d), dtype=numpy.float32).astype(dtype) for _ in range(2))
            ref = cupy.matmul(a.astype(numpy.float32).transpose(0, 2, 1), b.astype(numpy.float32))
            c = cupy.empty((2, d, d), numpy.float32)
            for kind in ("nt", "tn"):
                x, y = (a, b) if kind == "nt" else (cupy.ascontiguousarray(a.transpose(0, 2, 1)),
                                                    cupy.ascontiguousarray(b.transpose(0, 2, 1)))
                for batch in (1, 2):
                    flop = 2 * batch * m * d * d
                    xs, ys, cs = x[:batch], y[:batch], c[:batch]
                    trans = {"trans_a": True} if kind == "nt" else {"trans_b": True}

                    def cublas(xs=xs, ys=ys, cs=cs, trans=trans):
                        gemm.matmul_batched(xs, ys, cs, compute=compute, **trans)
                    pointers = pointer_arrays(cublas_handle, xs, ys, cs, kind, compute)
                    for run in (cublas, pointers):
                        c.fill(numpy.nan)
                        run()
                        error = float(cupy.abs(cs - ref[:batch]).max() / cupy.abs(ref).max())
                        if not error < 1e-2:
                            raise SystemExit(f"cuBLAS product wrong: error {error:.1e}")
                    rows = [("cuBLAS strided", median_us(cublas), ""),
                            ("cuBLAS pointer arrays", median_us(pointers), "")]
                    product = LtProduct(handle, xs, ys, cs, kind, compute)
                    found = product.candidates()
                    timed = []
                    for i, result in found:
                        c.fill(numpy.nan)
                        product.run(result)
                        error = float(cupy.abs(cs - ref[:batch]).max() / cupy.abs(ref).max())
                        if not error < 1e-2:
                            print(f"  candidate {i} wrong: error {error:.1e} ({describe(result)})")
                            continue
                        timed.append((median_us(lambda r=result: product.run(r)), i, result))
                    if timed:
                        first = next((t for t in timed if t[1] == 0), None)
                        if first:
                            rows.append(("Lt heuristic #0", first[0], describe(first[2])))
                        best = min(timed, key=lambda t: t[0])
                        rows.append((f"Lt best of {len(timed)} (#{best[1]})", best[0], describe(best[2])))
                    print(f"M={m} {name} {kind} batch {batch}:")
                    for label, us, what in rows:
                        print(f"  {label:22s} {us:8.1f} us {flop / us / 1e6:7.1f} TFLOP/s  {what}", flush=True)


if __name__ == "__main__":
    main()
