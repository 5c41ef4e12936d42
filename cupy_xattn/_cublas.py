"""cuBLAS through ctypes, on the libcublas that CuPy loaded, with handles of our own.

CuPy's wrappers refuse to run while a stream is being captured into a CUDA graph, and have no
``cublasGemmBatchedEx``. Both are needed by plans: a graph replays with the inputs at new
addresses, so every GEMM reads its operand addresses from a small device table
(``cublasGemmBatchedEx`` takes device arrays of pointers) that is rewritten before each replay.
"""

import ctypes
import threading

from ._cupy import import_cupy
from .gemm import GEMM_DEFAULT

_lib = None
_lock = threading.Lock()

_c_int, _c_void_p, _c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
POINTER_MODE_DEVICE = 1


class CublasError(RuntimeError):
    pass


def _library():
    """The libcublas already mapped into this process by CuPy (same library, same version)."""
    global _lib
    with _lock:
        if _lib is None:
            import cupy_backends.cuda.libs.cublas  # noqa: F401  (maps libcublas into the process)

            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcublas.so" in line and "Lt" not in line}
            if not paths:
                raise CublasError("libcublas is not loaded by CuPy; cannot bind cublasGemmBatchedEx")
            lib = ctypes.CDLL(sorted(paths)[0])
            for name, args in {
                "cublasCreate_v2": [ctypes.POINTER(_c_void_p)],
                "cublasDestroy_v2": [_c_void_p],
                "cublasSetStream_v2": [_c_void_p, _c_void_p],
                "cublasSetWorkspace_v2": [_c_void_p, _c_void_p, _c_size_t],
                "cublasSetPointerMode_v2": [_c_void_p, _c_int],
                "cublasSetSmCountTarget": [_c_void_p, _c_int],
                "cublasGemmBatchedEx": [_c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int, _c_void_p,
                                        _c_void_p, _c_int, _c_int, _c_void_p, _c_int, _c_int, _c_void_p,
                                        _c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int],
            }.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, _c_int
            _lib = lib
    return _lib


def _check(status, what):
    if status != 0:
        raise CublasError(f"{what} failed with cuBLAS status {status}")


class Handle:
    """A cuBLAS handle bound to one stream, with a fixed workspace and device-side alpha/beta.

    A fixed workspace keeps cuBLAS from allocating during graph capture; device pointer mode
    lets alpha come from a kernel (the fp16 mode's scales) with no host synchronisation.
    """

    WORKSPACE_BYTES = 32 << 20

    def __init__(self, stream):
        cupy = import_cupy()
        self._lib = _library()
        self._handle = _c_void_p()
        _check(self._lib.cublasCreate_v2(ctypes.byref(self._handle)), "cublasCreate")
        self.workspace = cupy.empty(self.WORKSPACE_BYTES, cupy.uint8)
        _check(self._lib.cublasSetStream_v2(self._handle, _c_void_p(stream.ptr)), "cublasSetStream")
        _check(self._lib.cublasSetWorkspace_v2(self._handle, _c_void_p(self.workspace.data.ptr),
                                               self.WORKSPACE_BYTES), "cublasSetWorkspace")
        _check(self._lib.cublasSetPointerMode_v2(self._handle, POINTER_MODE_DEVICE), "cublasSetPointerMode")

    def gemm_batched(self, trans_a, trans_b, m, n, k, alpha, a_array, a_type, lda, b_array, b_type, ldb,
                     beta, c_array, c_type, ldc, batch, compute, sm_target=0):
        """Column-major ``cublasGemmBatchedEx``; every pointer argument is a device address.
        ``sm_target``: the SMs cuBLAS's heuristics plan the product for (cublasSetSmCountTarget;
        0: all of them), for a product that runs beside others."""
        _check(self._lib.cublasSetSmCountTarget(self._handle, sm_target), "cublasSetSmCountTarget")
        _check(self._lib.cublasGemmBatchedEx(
            self._handle, trans_a, trans_b, m, n, k, _c_void_p(alpha), _c_void_p(a_array), a_type, lda,
            _c_void_p(b_array), b_type, ldb, _c_void_p(beta), _c_void_p(c_array), c_type, ldc,
            batch, compute, GEMM_DEFAULT), "cublasGemmBatchedEx")

    def __del__(self):
        if getattr(self, "_handle", None) and self._handle.value:
            self._lib.cublasDestroy_v2(self._handle)
