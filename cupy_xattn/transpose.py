"""Launcher of ``kernels_cu/transpose.cu``: transposed copies for the TF32 GEMMs."""

import numpy

from . import kernels

SOURCE = "transpose.cu"
_TILE, _THREADS = 64, 256


class Transposed:
    """S_i^T for n row-major [rows][cols] float32 matrices S_i whose addresses are n consecutive
    entries of a pointer table at ``sources_address``: each written as [cols][ld] at device
    address ``dst + 4·i·dst_step``. Defaults: side by side, ``[S_0^T | … | S_{n−1}^T]``
    (dst_step = rows, ld = n·rows). The matrices must be 16-byte aligned; float4 accesses where
    cols, ld and dst_step are multiples of 4, floats otherwise.

    With ``sums`` (a device address), S_i for i ≥ ``sum_from`` also get column sums by blocks of
    rows: ``sums`` is then float32 [n − sum_from][row_tiles(rows)][cols], whose sums over the
    middle axis are the column sums of the S_i."""

    @staticmethod
    def row_tiles(rows):
        """Blocks of rows that ``sums`` holds one partial column sum for."""
        return -(-rows // _TILE)

    def __init__(self, sources_address, n, dst, rows, cols, ld=None, dst_step=None, sums=0, sum_from=0):
        ld = n * rows if ld is None else ld
        dst_step = rows if dst_step is None else dst_step
        apart = dst_step >= cols * ld  # each copy in its own [cols][ld] block, else columns side by side
        if ld < rows or (n > 1 and not apart and (dst_step < rows or (n - 1) * dst_step + rows > ld)):
            raise ValueError(f"transposed copies overlap: n {n}, rows {rows}, cols {cols}, ld {ld}, "
                             f"dst_step {dst_step}")
        if not 0 <= sum_from < n:
            raise ValueError(f"sum_from {sum_from} is not one of the {n} matrices")
        vec = 4 if cols % 4 == ld % 4 == dst_step % 4 == 0 else 1
        self._kernel = kernels.get_kernel(SOURCE, "transposed_copies", {"TR_VEC": vec})
        self._grid = (self.row_tiles(rows), -(-cols // _TILE), n)
        self._args = (numpy.uint64(sources_address), numpy.uint64(dst), numpy.int64(dst_step), numpy.int32(rows),
                      numpy.int32(cols), numpy.int64(ld), numpy.uint64(sums), numpy.int32(sum_from))

    def __call__(self):
        self._kernel(self._grid, (_THREADS,), self._args)
