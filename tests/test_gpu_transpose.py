"""The transpose kernel alone (marker ``gpu``): exact copies, every element written, the rest untouched."""
import numpy
import pytest

from cupy_xattn.transpose import Transposed

pytestmark = pytest.mark.gpu


def _sources(n, rows, cols):
    import cupy
    rng = numpy.random.default_rng(rows + cols + n)
    sources = [cupy.asarray(rng.standard_normal((rows, cols), dtype=numpy.float32)) for _ in range(n)]
    return sources, cupy.array([s.data.ptr for s in sources], numpy.uint64)


@pytest.mark.parametrize("n, rows, cols, pad", [(1, 1024, 1024, 0), (3, 1024, 1024, 0), (3, 64, 64, 0), (2, 40, 40, 0),
                                                (1, 8192, 1024, 0), (1, 1382, 256, 26), (2, 33, 70, 5),
                                                (1, 65535 * 64 + 40, 8, 24)])  # row tiles past gridDim.y's limit
def test_transposed_copies_side_by_side_are_exact(n, rows, cols, pad):
    import cupy
    sources, table = _sources(n, rows, cols)
    dst = cupy.full((cols, n * rows + pad), numpy.nan, numpy.float32)
    Transposed(table.data.ptr, n, dst.data.ptr, rows, cols, ld=n * rows + pad)()
    got = cupy.asnumpy(dst)
    numpy.testing.assert_array_equal(got[:, :n * rows], numpy.concatenate([cupy.asnumpy(s).T for s in sources], 1))
    if pad:
        assert numpy.isnan(got[:, n * rows:]).all()  # the padding columns are not written


@pytest.mark.parametrize("n, rows, cols, ld", [(2, 8192, 1024, 8192), (2, 154, 1024, 160), (1, 77, 2048, 96)])
def test_transposed_copies_apart_keep_their_own_rows(n, rows, cols, ld):
    import cupy
    sources, table = _sources(n, rows, cols)
    dst = cupy.full((n, cols, ld), numpy.nan, numpy.float32)
    Transposed(table.data.ptr, n, dst.data.ptr, rows, cols, ld=ld, dst_step=cols * ld)()
    got = cupy.asnumpy(dst)
    for i, s in enumerate(sources):
        numpy.testing.assert_array_equal(got[i, :, :rows], cupy.asnumpy(s).T)
    assert numpy.isnan(got[:, :, rows:]).all()


@pytest.mark.parametrize("n, rows, cols, ld, sum_from", [(2, 1382, 256, None, 1), (1, 154, 2048, None, 0),
                                                         (3, 33, 70, None, 1),  # floats (TR_VEC = 1)
                                                         (2, 1382, 256, 1408, 1), (1, 154, 2048, 160, 0)])  # float4s
def test_transposed_copies_write_column_sums_of_each_block_of_rows(n, rows, cols, ld, sum_from):
    import cupy
    sources, table = _sources(n, rows, cols)
    tiles = Transposed.row_tiles(rows)
    sums = cupy.full((n - sum_from, tiles, cols), numpy.nan, numpy.float32)
    apart = ld is not None  # as the backward lays out X^T, dY^T: [cols][ld] blocks, rows padded
    dst = cupy.full((n, cols, ld) if apart else (cols, n * rows), numpy.nan, numpy.float32)
    Transposed(table.data.ptr, n, dst.data.ptr, rows, cols, ld=ld, dst_step=cols * ld if apart else None,
               sums=sums.data.ptr, sum_from=sum_from)()
    got = cupy.asnumpy(sums)
    for i, s in enumerate(sources[sum_from:]):
        s = cupy.asnumpy(s).astype(numpy.float64)
        blocks = numpy.stack([s[t * 64:(t + 1) * 64].sum(0) for t in range(tiles)])
        numpy.testing.assert_allclose(got[i], blocks, rtol=1e-5, atol=1e-5)
    expected = [cupy.asnumpy(s).T for s in sources]
    got = cupy.asnumpy(dst)
    numpy.testing.assert_array_equal(got[:, :, :rows] if apart else got,
                                     numpy.stack(expected) if apart else numpy.concatenate(expected, 1))
