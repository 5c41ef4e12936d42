"""cuBLAS and cuBLASLt through ctypes, on the libraries that CuPy loaded, with handles of our own.

CuPy's wrappers refuse to run while a stream is being captured into a CUDA graph, and have no
``cublasGemmBatchedEx`` and no cuBLASLt. Plans need all three: a graph replays with the inputs at
new addresses, so every GEMM that reads a caller array reads its operand addresses from a small
device table (``cublasGemmBatchedEx`` takes device arrays of pointers) that is rewritten before
each replay; a GEMM over buffers of the plan's own, whose addresses never change, may instead be a
``cublasLtMatmul`` with an epilogue (:meth:`Handle.bias_gemm`).
"""

import ctypes
import threading

from ._cupy import import_cupy
from .gemm import COMPUTE_32F, GEMM_DEFAULT, R_16F, R_32F

_lib = _lt = None
_lt_handles = {}  # device id -> cuBLASLt handle (a handle belongs to the device it was created on)
_lock = threading.Lock()

_c_int, _c_void_p, _c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
POINTER_MODE_DEVICE = 1


class CublasError(RuntimeError):
    pass


def _mapped(name):
    """ctypes handle of the library ``name`` ("libcublas.so", "libcublasLt.so") as CuPy mapped it
    into this process (libcublas brings libcublasLt: same version)."""
    import cupy_backends.cuda.libs.cublas  # noqa: F401  (maps libcublas into the process)

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if name in line.split()[-1]}
    if not paths:
        raise CublasError(f"{name} is not loaded by CuPy; cannot bind it")
    return ctypes.CDLL(sorted(paths)[0])


def _bind(lib, signatures):
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _c_int
    return lib


def _library():
    """libcublas, with the functions Handle calls."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = _bind(_mapped("libcublas.so"), {
                "cublasCreate_v2": [ctypes.POINTER(_c_void_p)],
                "cublasDestroy_v2": [_c_void_p],
                "cublasSetStream_v2": [_c_void_p, _c_void_p],
                "cublasSetWorkspace_v2": [_c_void_p, _c_void_p, _c_size_t],
                "cublasSetPointerMode_v2": [_c_void_p, _c_int],
                "cublasSetSmCountTarget": [_c_void_p, _c_int],
                "cublasGemmBatchedEx": [_c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int, _c_void_p,
                                        _c_void_p, _c_int, _c_int, _c_void_p, _c_int, _c_int, _c_void_p,
                                        _c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int],
            })
    return _lib


class LtHeuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", _c_size_t), ("state", _c_int),
                ("waves", ctypes.c_float), ("reserved", _c_int * 4)]


def lt_library():
    """libcublasLt, with the functions LtMatmul (and scripts/lt_probe.py) call."""
    global _lt
    with _lock:
        if _lt is None:
            p, i32, u64, i64, size = _c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64, _c_size_t
            lib = _bind(_mapped("libcublasLt.so"), {
                "cublasLtCreate": [p], "cublasLtMatmulDescCreate": [p, i32, i32], "cublasLtMatmulDescDestroy": [p],
                "cublasLtMatmulDescSetAttribute": [p, i32, p, size],
                "cublasLtMatrixLayoutCreate": [p, i32, u64, u64, i64], "cublasLtMatrixLayoutDestroy": [p],
                "cublasLtMatrixLayoutSetAttribute": [p, i32, p, size],
                "cublasLtMatmulPreferenceCreate": [p], "cublasLtMatmulPreferenceDestroy": [p],
                "cublasLtMatmulPreferenceSetAttribute": [p, i32, p, size],
                "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i32, p, p],
                "cublasLtMatmulAlgoConfigGetAttribute": [p, i32, p, size, p],
                "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, size, p],
            })
            _lt = lib
    return _lt


def lt_handle():
    """The cuBLASLt handle of the current device, created at its first use and kept for the process."""
    lib, device = lt_library(), import_cupy().cuda.runtime.getDevice()
    with _lock:
        if device not in _lt_handles:
            handle = _c_void_p()
            _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            _lt_handles[device] = handle
        return _lt_handles[device]


# cublasLtMatmulDescAttributes_t, cublasLtEpilogue_t, cublasLtMatmulPreferenceAttributes_t
_DESC_POINTER_MODE, _DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER, _DESC_SM_COUNT_TARGET = 2, 3, 4, 7, 8, 15
_EPILOGUE_BIAS = 4
_PREF_MAX_WORKSPACE_BYTES = 1


def lt_set(setter, obj, attribute, value, ctype):
    """Set one attribute of a cuBLASLt descriptor (``setter``: its SetAttribute function)."""
    v = ctype(value)
    _check(setter(obj, attribute, ctypes.byref(v), ctypes.sizeof(v)), f"cuBLASLt attribute {attribute}")


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
        self._handle, self._stream = _c_void_p(), stream
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

    def bias_gemm(self, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, d, ldd, bias, sm_target=0):
        """Column-major ``d = alpha · op(a) op(b) + bias`` (bias[i] added to row i of d) over fp16 a, b,
        d and bias with fp32 accumulation (``cublasLtMatmul``, the CUBLASLT_EPILOGUE_BIAS epilogue, the
        algorithm its heuristic ranks first), on this handle's stream and workspace. Every argument
        is a device address, used as it is by every call: for buffers that do not move.
        Returns the call (it chooses the algorithm now)."""
        return LtMatmul(self._stream, self.workspace, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, d, ldd,
                        bias, sm_target)

    def __del__(self):
        if getattr(self, "_handle", None) and self._handle.value:
            self._lib.cublasDestroy_v2(self._handle)


class LtMatmul:
    """One ``cublasLtMatmul`` of fixed shape and addresses (Handle.bias_gemm), callable."""

    def __init__(self, stream, workspace, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, d, ldd, bias,
                 sm_target):
        self._lib, self._handle = lt_library(), lt_handle()
        lib, i32 = self._lib, ctypes.c_int32
        self._desc, self._layouts, self._preference = _c_void_p(), [], _c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), COMPUTE_32F, R_32F), "cublasLtMatmulDescCreate")
        for attribute, value, ctype in ((_DESC_POINTER_MODE, POINTER_MODE_DEVICE, i32), (_DESC_TRANSA, trans_a, i32),
                                        (_DESC_TRANSB, trans_b, i32), (_DESC_SM_COUNT_TARGET, sm_target, i32),
                                        (_DESC_EPILOGUE, _EPILOGUE_BIAS, ctypes.c_uint32),
                                        (_DESC_BIAS_POINTER, bias, _c_void_p)):
            lt_set(lib.cublasLtMatmulDescSetAttribute, self._desc, attribute, value, ctype)
        for rows, cols, ld in (((k, m) if trans_a else (m, k)) + (lda,), ((n, k) if trans_b else (k, n)) + (ldb,),
                               (m, n, ldd)):
            layout = _c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), R_16F, rows, cols, ld),
                   "cublasLtMatrixLayoutCreate")
            self._layouts.append(layout)
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self._preference)), "cublasLtMatmulPreferenceCreate")
        lt_set(lib.cublasLtMatmulPreferenceSetAttribute, self._preference, _PREF_MAX_WORKSPACE_BYTES,
               workspace.nbytes, ctypes.c_uint64)
        self._algo, found = LtHeuristic(), _c_int(0)
        a_layout, b_layout, d_layout = self._layouts
        _check(lib.cublasLtMatmulAlgoGetHeuristic(self._handle, self._desc, a_layout, b_layout, d_layout, d_layout,
                                                  self._preference, 1, ctypes.byref(self._algo), ctypes.byref(found)),
               "cublasLtMatmulAlgoGetHeuristic")
        if found.value < 1:
            raise CublasError(f"cuBLASLt has no algorithm for a {m}x{n}x{k} fp16 product with a bias")
        self._args = (self._handle, self._desc, _c_void_p(alpha), _c_void_p(a), a_layout, _c_void_p(b), b_layout,
                      _c_void_p(beta), _c_void_p(d), d_layout, _c_void_p(d), d_layout, ctypes.byref(self._algo.algo),
                      _c_void_p(workspace.data.ptr), workspace.nbytes, _c_void_p(stream.ptr))
        self.workspace = workspace  # alive as long as the call

    def __call__(self):
        _check(self._lib.cublasLtMatmul(*self._args), "cublasLtMatmul")

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        for layout in getattr(self, "_layouts", []):
            lib.cublasLtMatrixLayoutDestroy(layout)
        for obj, destroy in ((self._desc, lib.cublasLtMatmulDescDestroy),
                             (self._preference, lib.cublasLtMatmulPreferenceDestroy)):
            if obj.value:
                destroy(obj)
