"""Launcher of ``kernels_cu/half_scaling.cu``: fp16 copies with per-tensor power-of-two scales."""

import numpy

from . import kernels
from ._cupy import import_cupy

SOURCE = "half_scaling.cu"
_THREADS = 256


class HalfScaler:
    """Scaled fp16 copies of fp32 tensors, each tensor (or group of tensors) in a numbered slot.

    Per run: :meth:`reset`, then :meth:`absmax` of every tensor of a slot, then :meth:`convert`
    of each (``y = half(x · s_slot)``), then :meth:`update_alphas`; ``alpha(i, j)`` is the device
    address of ``1 / (s_i · s_j)``, the alpha that undoes the scaling of a GEMM of slots i and j.
    Nothing is read back to the host, so a run can be captured into a CUDA graph.
    """

    def __init__(self, n_slots, sm_count):
        cupy = import_cupy()
        self.n_slots = n_slots
        self._max_blocks = 4 * sm_count
        # One buffer: amax bits, inverse scales, then the n × n alphas.
        self._state = cupy.zeros(2 * n_slots + n_slots * n_slots, numpy.float32)
        self._amax_bits = self._state.data.ptr
        self._inv_scale = self._state.data.ptr + 4 * n_slots
        self._alpha = self._state.data.ptr + 8 * n_slots
        self._absmax = kernels.get_kernel(SOURCE, "half_absmax")
        self._convert = kernels.get_kernel(SOURCE, "half_convert")
        self._alphas = kernels.get_kernel(SOURCE, "half_alphas")

    def _grid(self, size):
        if size % 4:
            raise ValueError("half conversion needs a size that is a multiple of 4")
        return (max(1, min(-(-size // 4 // _THREADS), self._max_blocks)),), numpy.int64(size // 4)

    def reset(self, stream):
        """Zero the running maxima (first step of every run)."""
        import_cupy().cuda.runtime.memsetAsync(self._amax_bits, 0, 4 * self.n_slots, stream.ptr)

    def absmax(self, x_address, size, slot):
        """Fold max|x| into ``slot``; ``x_address`` is the device address holding x's address."""
        grid, n4 = self._grid(size)
        self._absmax(grid, (_THREADS,), (numpy.uint64(x_address), n4, numpy.uint64(self._amax_bits + 4 * slot)))

    def convert(self, x_address, size, y, slot):
        """``y = half(x · s_slot)`` into the float16 array ``y`` of ``size`` elements."""
        grid, n4 = self._grid(size)
        self._convert(grid, (_THREADS,), (numpy.uint64(x_address), y, n4,
                                          numpy.uint64(self._amax_bits + 4 * slot),
                                          numpy.uint64(self._inv_scale + 4 * slot)))

    def update_alphas(self):
        n = self.n_slots
        self._alphas((1,), (n * n,), (numpy.uint64(self._inv_scale), numpy.uint64(self._alpha), numpy.int32(n)))

    def alpha(self, i, j):
        return self._alpha + 4 * (i * self.n_slots + j)
