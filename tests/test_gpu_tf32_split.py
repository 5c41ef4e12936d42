"""The TF32 split kernel alone (marker ``gpu``): hi has TF32's bits, hi + lo is x, in place too."""
import numpy
import pytest

from cupy_xattn.tf32_split import Tf32Split

pytestmark = pytest.mark.gpu


def _split(x, in_place=False):
    import cupy
    hi = x.copy() if in_place else cupy.full(x.shape, numpy.nan, numpy.float32)
    lo = cupy.full(x.shape, numpy.nan, numpy.float32)
    sources = cupy.array([hi.data.ptr if in_place else x.data.ptr], numpy.uint64)
    Tf32Split(sources.data.ptr, [(x.size, hi.data.ptr, lo.data.ptr)], 132)()
    return cupy.asnumpy(hi), cupy.asnumpy(lo)


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in-place"])
def test_hi_is_tf32_and_hi_plus_lo_is_x(in_place):
    import cupy
    rng = numpy.random.default_rng(5)
    x = (rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-30, 30, 1 << 16)).astype(numpy.float32)
    hi, lo = _split(cupy.asarray(x), in_place)
    assert not (hi.view(numpy.uint32) & 0x1FFF).any()  # TF32: the low 13 mantissa bits are zero
    numpy.testing.assert_array_equal(hi + lo, x)  # exact in fp32
    assert (numpy.abs(lo) <= numpy.abs(x) * 2.0 ** -11).all()  # rounded to nearest
    assert numpy.abs(lo).max() > 0


def test_non_finite_and_huge_values():
    import cupy
    big = numpy.float32(3.4028e38)  # rounds past the largest float: truncated instead
    x = numpy.array([numpy.inf, -numpy.inf, numpy.nan, big, -big, 1.0, 0.0, -0.0], numpy.float32)
    hi, lo = _split(cupy.asarray(x))
    assert numpy.isposinf(hi[0]) and numpy.isneginf(hi[1]) and numpy.isnan(hi[2])
    assert (lo[:3] == 0).all() and numpy.isfinite(hi[3:]).all() and numpy.isfinite(lo).all()
    numpy.testing.assert_array_equal(hi[3:] + lo[3:], x[3:])
