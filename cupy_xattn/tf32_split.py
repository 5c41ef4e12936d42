"""Launcher of ``kernels_cu/tf32_split.cu``: (hi, lo) TF32 pairs for the fp32 mode's 3xTF32 GEMMs."""

import numpy

from . import kernels
from ._cupy import import_cupy

SOURCE = "tf32_split.cu"
_THREADS = 256


class Tf32Split:
    """``hi = tf32(x)``, ``lo = x − hi`` for a group of fp32 tensors, in one launch.

    Parameters
    ----------
    sources_address : device address of consecutive addresses of the sources.
    tensors : list of ``(size, hi, lo)``: element count (a multiple of 4) and destination addresses.
    sm_count : multiprocessors of the GPU, for the grid.
    """

    def __init__(self, sources_address, tensors, sm_count):
        if any(size % 4 for size, _, _ in tensors):
            raise ValueError("the TF32 split needs sizes that are multiples of 4")
        n = len(tensors)
        self._meta = import_cupy().array([size // 4 for size, _, _ in tensors] + [hi for _, hi, _ in tensors]
                                         + [lo for _, _, lo in tensors], numpy.int64)
        blocks = max(1, min(-(-max(size for size, _, _ in tensors) // 4 // _THREADS), 2 * sm_count))
        self._kernel = kernels.get_kernel(SOURCE, "tf32_split")
        self._grid, self._args = (blocks, n), (numpy.uint64(sources_address), self._meta, numpy.int32(n))

    def __call__(self):
        self._kernel(self._grid, (_THREADS,), self._args)
