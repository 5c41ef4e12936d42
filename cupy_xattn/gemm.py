"""Row-major GEMMs through CuPy's cuBLAS binding with an explicit compute type (naive baseline).

CuPy's ``matmul`` applies TF32 only to 2-D products and only through ``CUPY_TF32``, read
once per process; calling ``gemmEx`` ourselves fixes the compute type per call.

cuBLAS is column-major: a row-major ``C[M, N] = op(A) op(B)`` is the column-major product
``C^T = op(B)^T op(A)^T``, so B is passed first and no data moves.
"""

import numpy

from ._cupy import import_cupy

# cublasComputeType_t and cudaDataType_t values (cublas_api.h, library_types.h).
COMPUTE_32F = 68              # IEEE fp32 FFMA
COMPUTE_32F_FAST_TF32 = 77    # TF32 tensor cores, fp32 accumulation
R_32F = 0
R_16F = 2
GEMM_DEFAULT = -1            # cublasGemmAlgo_t: cuBLAS's heuristic
OP_N, OP_T = 0, 1            # cublasOperation_t

#: compute type for the projection GEMMs of each precision mode (fp16 data uses COMPUTE_32F:
#: the operand type, not the compute type, selects the fp16 tensor-core kernels; so the
#: backward's fp32 mode, whose operands are fp16 copies and remainders, uses it too).
COMPUTE_TYPE = {"fp32": COMPUTE_32F, "tf32": COMPUTE_32F_FAST_TF32, "fp16": COMPUTE_32F}

_DATA_TYPE = {numpy.dtype(numpy.float32): R_32F, numpy.dtype(numpy.float16): R_16F}
_ONE = numpy.ones(1, numpy.float32)
_ZERO = numpy.zeros(1, numpy.float32)


def _row_major_2d(x, name):
    if x.ndim != 2 or x.strides[1] != x.itemsize or x.strides[0] % x.itemsize:
        raise ValueError(f"{name} must be a 2-D array with unit column stride, got strides {x.strides}")
    return x.strides[0] // x.itemsize


def matmul(a, b, c, *, trans_a=False, trans_b=False, compute=COMPUTE_32F_FAST_TF32,
           alpha=None, accumulate=False):
    """``c = alpha · op(a) @ op(b) (+ c if accumulate)`` for row-major 2-D CuPy arrays.

    Parameters
    ----------
    a : (M, K) or, with ``trans_a``, (K, M)
    b : (K, N) or, with ``trans_b``, (N, K)
    c : (M, N) float32; rows may be strided (a column block of a wider matrix).
    trans_a, trans_b : read a, b transposed (no copy: cuBLAS's operation flags).
    compute : cuBLAS compute type (``COMPUTE_32F`` or ``COMPUTE_32F_FAST_TF32``).
    alpha : a float32 NumPy array of one element (kept alive by the caller), default 1.
    accumulate : add the product to c's present values (beta = 1) instead of overwriting them.

    Returns ``c``. Raises ValueError when an array is not 2-D with unit column stride or the
    shapes do not chain.
    """
    cupy = import_cupy()
    from cupy_backends.cuda.libs import cublas

    lda, ldb, ldc = _row_major_2d(a, "a"), _row_major_2d(b, "b"), _row_major_2d(c, "c")
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != k_b or c.shape != (m, n):
        raise ValueError(f"matmul shapes do not match: a {a.shape} (trans={trans_a}), "
                         f"b {b.shape} (trans={trans_b}), c {c.shape}")
    alpha = _ONE if alpha is None else alpha
    beta = _ONE if accumulate else _ZERO
    handle = cupy.cuda.device.get_cublas_handle()
    # gemmEx sets the handle's stream to CuPy's current stream itself.
    cublas.gemmEx(handle, OP_T if trans_b else OP_N, OP_T if trans_a else OP_N,
                  n, m, k, alpha.ctypes.data,
                  b.data.ptr, _DATA_TYPE[b.dtype], ldb,
                  a.data.ptr, _DATA_TYPE[a.dtype], lda,
                  beta.ctypes.data, c.data.ptr, _DATA_TYPE[c.dtype], ldc,
                  compute, GEMM_DEFAULT)
    return c


def matmul_batched(a, b, c, *, trans_a=False, trans_b=False, compute=COMPUTE_32F_FAST_TF32, alpha=None):
    """``c[i] = alpha · op(a[i]) @ op(b[i])`` for C-contiguous 3-D CuPy arrays (one cuBLAS call).

    Shapes as in :func:`matmul` with a leading batch dimension; ``a`` or ``b`` may have a batch
    of 1, which is broadcast (stride 0).
    """
    cupy = import_cupy()
    from cupy_backends.cuda.libs import cublas

    for name, x in (("a", a), ("b", b), ("c", c)):
        if x.ndim != 3 or not x.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous 3-D array, got shape {x.shape}")
    m, k = (a.shape[2], a.shape[1]) if trans_a else a.shape[1:]
    k_b, n = (b.shape[2], b.shape[1]) if trans_b else b.shape[1:]
    batch = c.shape[0]
    if k != k_b or c.shape[1:] != (m, n) or a.shape[0] not in (1, batch) or b.shape[0] not in (1, batch):
        raise ValueError(f"matmul_batched shapes do not match: a {a.shape} (trans={trans_a}), "
                         f"b {b.shape} (trans={trans_b}), c {c.shape}")
    alpha = _ONE if alpha is None else alpha
    handle = cupy.cuda.device.get_cublas_handle()
    stride = lambda x: 0 if x.shape[0] == 1 else x.shape[1] * x.shape[2]  # noqa: E731
    cublas.gemmStridedBatchedEx(
        handle, OP_T if trans_b else OP_N, OP_T if trans_a else OP_N, n, m, k, alpha.ctypes.data,
        b.data.ptr, _DATA_TYPE[b.dtype], b.shape[2], stride(b),
        a.data.ptr, _DATA_TYPE[a.dtype], a.shape[2], stride(a),
        _ZERO.ctypes.data, c.data.ptr, _DATA_TYPE[c.dtype], n, stride(c),
        batch, compute, GEMM_DEFAULT)
    return c
