"""Launcher of ``kernels_cu/half_scaling.cu``: fp16 copies with per-tensor power-of-two scales."""

import numpy

from . import kernels
from ._cupy import import_cupy

SOURCE = "half_scaling.cu"
_THREADS = 256


def _grid(n4, sm_count):
    return (max(1, min(-(-n4 // _THREADS), 4 * sm_count)),)


class HalfScaler:
    """Scaled fp16 copies of fp32 tensors, each in a numbered slot.

    ``convert(x, slot)`` returns ``half(x · s_slot)``; ``alpha(i, j)`` is the device address of
    ``1 / (s_i · s_j)``, the GEMM alpha that undoes the scaling of a product of slots i and j.
    Call :meth:`update_alphas` after converting the slots a GEMM uses and before the GEMM.
    Everything stays on the device: no host synchronisation.
    """

    def __init__(self, n_slots, sm_count):
        cupy = import_cupy()
        self.n_slots = n_slots
        self._sm_count = sm_count
        # One zeroed buffer (one memset): amax bits, inverse scales, then the n × n alphas.
        self._state = cupy.zeros(2 * n_slots + n_slots * n_slots, numpy.float32)
        self._amax_bits = self._state[:n_slots].view(numpy.uint32)
        self._inv_scale = self._state[n_slots:2 * n_slots]
        self._alpha = self._state[2 * n_slots:]

    def convert(self, x, slot):
        cupy = import_cupy()
        if x.size % 4 or not x.flags.c_contiguous:
            raise ValueError("half conversion needs a C-contiguous array whose size is a multiple of 4")
        y = cupy.empty(x.shape, numpy.float16)
        n4 = numpy.int64(x.size // 4)
        grid = _grid(x.size // 4, self._sm_count)
        kernels.get_kernel(SOURCE, "half_absmax")(grid, (_THREADS,), (x, n4, self._amax_bits[slot:]))
        kernels.get_kernel(SOURCE, "half_convert")(
            grid, (_THREADS,), (x, y, n4, self._amax_bits[slot:], self._inv_scale[slot:]))
        return y

    def update_alphas(self):
        n = self.n_slots
        kernels.get_kernel(SOURCE, "half_alphas")((1,), (n * n,), (self._inv_scale, self._alpha, numpy.int32(n)))

    def alpha(self, i, j):
        return self._alpha.data.ptr + 4 * (i * self.n_slots + j)
