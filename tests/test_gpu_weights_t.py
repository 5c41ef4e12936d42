"""The weight-transpose kernel alone (marker ``gpu``): exact copies, every element written."""
import numpy
import pytest

from cupy_xattn.weights_t import WeightsTransposed

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n, d", [(1, 1024), (3, 1024), (3, 64), (2, 40)])
def test_weights_transposed_is_the_exact_transpose_side_by_side(n, d):
    import cupy
    rng = numpy.random.default_rng(d + n)
    weights = [cupy.asarray(rng.standard_normal((d, d), dtype=numpy.float32)) for _ in range(n)]
    table = cupy.array([w.data.ptr for w in weights], numpy.uint64)
    dst = cupy.full((d, n * d), numpy.nan, numpy.float32)
    WeightsTransposed(table.data.ptr, n, dst.data.ptr, d)()
    expected = numpy.concatenate([cupy.asnumpy(w).T for w in weights], axis=1)
    numpy.testing.assert_array_equal(cupy.asnumpy(dst), expected)
