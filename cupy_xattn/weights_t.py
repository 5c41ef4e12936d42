"""Launcher of ``kernels_cu/weights_t.cu``: transposed copies of the weights for the TF32 GEMMs."""

import numpy

from . import kernels

SOURCE = "weights_t.cu"
_TILE, _ROWS = 32, 8


class WeightsTransposed:
    """``dst = [W_0^T | … | W_{n−1}^T]`` ([d][n·d] float32 at device address ``dst``) for n square
    [d][d] weights whose addresses are n consecutive entries of a pointer table at ``sources_address``."""

    def __init__(self, sources_address, n, dst, d):
        self._kernel = kernels.get_kernel(SOURCE, "weights_transposed")
        tiles = -(-d // _TILE)
        self._grid, self._args = (tiles, tiles, n), (numpy.uint64(sources_address), numpy.int32(n), numpy.uint64(dst),
                                                     numpy.int32(d))

    def __call__(self):
        self._kernel(self._grid, (_TILE, _ROWS), self._args)
