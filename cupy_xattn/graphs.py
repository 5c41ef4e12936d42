"""Captured CUDA graphs whose edges into this library's kernels are programmatic (sm_90 and later).

In a graph, a kernel normally starts only after the kernels it depends on have finished and their
writes have been flushed: in the small cases' chains of short kernels that gap is paid at every
step. With a programmatic edge (CUDA's programmatic dependent launch) the downstream kernel is
launched while the upstream one drains and waits inside, at its first statement
(kernels_cu/grid_dependency.cuh). Only this library's kernels begin with that wait, so only the
edges into them change; edges into cuBLAS's kernels stay as captured. CuPy does not expose a
graph's edges: the driver API is reached through ctypes.
"""
import ctypes
import functools
import warnings
import weakref

from . import kernels
from ._cupy import import_cupy

_KERNEL_NODE = 0        # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: every upstream block has finished (or triggered)
_TYPE_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
_ATTRIBUTE_PTX_VERSION = 5  # CU_FUNC_ATTRIBUTE_PTX_VERSION: the virtual architecture, e.g. 90


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class GraphError(RuntimeError):
    """A driver call on a captured graph failed."""


@functools.lru_cache(maxsize=None)
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _call(function, *args):
    call = getattr(_driver(), function, None)
    if call is None:
        raise GraphError(f"the CUDA driver has no {function} (it needs CUDA 12.3 or later)")
    status = call(*args)
    if status:
        raise GraphError(f"{function} failed (CUresult {status})")


def _node_array(*nodes):
    return (ctypes.c_void_p * len(nodes))(*nodes)


def _kernel(node):
    """(function name, virtual architecture it was compiled for, e.g. 90) of a kernel node launched
    from a CUfunction, ("", 0) of one launched from a CUkernel; None for another node."""
    node_type = ctypes.c_int()
    _call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(node_type))
    if node_type.value != _KERNEL_NODE:
        return None
    params = _KernelNodeParams()
    _call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
    if not params.func:  # launched as a CUkernel (a library's): an upstream kernel, never one of ours
        return "", 0
    name, arch = ctypes.c_char_p(), ctypes.c_int()
    _call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
    _call("cuFuncGetAttribute", ctypes.byref(arch), ctypes.c_int(_ATTRIBUTE_PTX_VERSION), ctypes.c_void_p(params.func))
    return (name.value or b"").decode(), arch.value


def make_programmatic(graph):
    """Turn every edge of ``graph`` (a cudaGraph_t) from a kernel node into one of this library's
    kernels into a programmatic edge, where that kernel was compiled for compute capability 9.0 or
    later (below, grid_dependency.cuh compiles its wait out). Returns the (upstream, downstream)
    kernel names of the edges changed."""
    handle = ctypes.c_void_p(graph)
    count = ctypes.c_size_t()
    _call("cuGraphGetEdges_v2", handle, None, None, None, ctypes.byref(count))
    sources, targets = _node_array(*[None] * count.value), _node_array(*[None] * count.value)
    data = (_EdgeData * count.value)()
    _call("cuGraphGetEdges_v2", handle, sources, targets, data, ctypes.byref(count))
    ours, found = kernels.kernel_names(), {}

    def kernel(node):
        if node not in found:
            found[node] = _kernel(node)
        return found[node]

    def waits(node):  # one of ours, built with its wait
        return kernel(node) is not None and kernel(node)[0] in ours and kernel(node)[1] >= 90

    edges = [(source, target) for source, target, edge in zip(sources, targets, data)
             if edge.type == 0 and edge.from_port == 0 and kernel(source) is not None and waits(target)]
    programmatic = _EdgeData(from_port=_PORT_PROGRAMMATIC, type=_TYPE_PROGRAMMATIC)
    for source, target in edges:
        _call("cuGraphRemoveDependencies_v2", handle, _node_array(source), _node_array(target), None, ctypes.c_size_t(1))
        _call("cuGraphAddDependencies_v2", handle, _node_array(source), _node_array(target), ctypes.byref(programmatic),
              ctypes.c_size_t(1))
    return [(kernel(source)[0], kernel(target)[0]) for source, target in edges]


class ProgrammaticGraph:
    """A graph captured by CuPy, instantiated again after ``make_programmatic``; ``launch(stream)``
    as CuPy's. Keeps CuPy's graph, which owns the captured cudaGraph_t (and its own instantiation,
    unused: the memory of one graph's executable twice). ``programmatic_edges``: the (upstream,
    downstream) kernel names of the edges made programmatic."""

    def __init__(self, captured, edges):
        self._captured, self.programmatic_edges = captured, edges
        runtime = import_cupy().cuda.runtime
        self._exec, self._launch = runtime.graphInstantiate(captured.graph), runtime.graphLaunch
        # A finalizer rather than __del__: at interpreter exit it runs before CuPy's modules are torn down.
        weakref.finalize(self, runtime.graphExecDestroy, self._exec)

    def launch(self, stream):
        self._launch(self._exec, stream.ptr)


def programmatic(captured):
    """``captured`` (a CuPy graph) with programmatic edges into this library's kernels, on GPUs of
    compute capability 9.0 and later; else, or when there is no such edge, ``captured`` itself.
    CuPy instantiated it before the edges changed, so ``captured`` is what runs if anything here
    fails (a driver before CUDA 12.3 lacks the calls; a driver may refuse to instantiate the
    changed graph), with a warning."""
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    cupy = import_cupy()
    if int(cupy.cuda.Device().compute_capability) < 90:
        return captured
    try:
        edges = make_programmatic(captured.graph)
        return ProgrammaticGraph(captured, edges) if edges else captured
    except (OSError, GraphError, CUDARuntimeError) as exc:
        warnings.warn(f"cupy_xattn: the graph keeps its ordinary edges ({exc})", RuntimeWarning, stacklevel=2)
        return captured
