"""The fp16 scaling kernels alone (marker ``gpu``): copies, remainders and scales."""
import numpy
import pytest

from cupy_xattn.half_scaling import HalfScaler, column_sum_rows

pytestmark = pytest.mark.gpu


def _convert(tensors, with_lo=True, runs=1):
    """fp16 copies, remainders (or None) and inverse scales of float32 CuPy ``tensors``, one slot
    each, after ``runs`` runs of one scaler (from the second on, the guessed scales are right and
    the copy pass's output stands)."""
    import cupy
    scaler = HalfScaler(len(tensors), 132)
    table = cupy.array([x.data.ptr for x in tensors], numpy.uint64)
    halves = [(cupy.full(x.size, numpy.nan, numpy.float16), cupy.full(x.size, numpy.nan, numpy.float16) if with_lo
               else None) for x in tensors]
    copy, rescale = scaler.group(table.data.ptr, [(x.size, hi.data.ptr, i, 0 if lo is None else lo.data.ptr, 0, 0)
                                                  for i, (x, (hi, lo)) in enumerate(zip(tensors, halves))])
    for _ in range(runs):
        copy(), rescale()
    return halves, cupy.asnumpy(scaler.inverse_scales())


def test_copy_plus_remainder_recovers_the_tensor_to_2_to_the_minus_22():
    import cupy
    rng = numpy.random.default_rng(3)
    values = [rng.standard_normal(4096) * 10.0 ** rng.integers(-6, 6, 4096),  # magnitudes over 12 decades
              rng.standard_normal(1024) * 1e-9, rng.standard_normal(1024) * 1e7]
    tensors = [cupy.asarray(v.astype(numpy.float32)) for v in values]
    halves, inverse = _convert(tensors)
    plain, _ = _convert(tensors, with_lo=False)
    steady, steady_inverse = _convert(tensors, runs=2)  # the second run's copies come from the copy pass
    numpy.testing.assert_array_equal(inverse, steady_inverse)
    for (hi, lo), (steady_hi, steady_lo) in zip(halves, steady):
        numpy.testing.assert_array_equal(cupy.asnumpy(hi), cupy.asnumpy(steady_hi))
        numpy.testing.assert_array_equal(cupy.asnumpy(lo), cupy.asnumpy(steady_lo))
    for x, (hi, lo), (plain_hi, _), inv in zip(tensors, halves, plain, inverse):
        x = cupy.asnumpy(x).astype(numpy.float64)
        hi, lo = cupy.asnumpy(hi).astype(numpy.float64), cupy.asnumpy(lo).astype(numpy.float64)
        numpy.testing.assert_array_equal(hi, cupy.asnumpy(plain_hi))  # the copy does not change
        assert numpy.abs(lo).max() <= 2.0 ** -11 * numpy.abs(hi).max()  # at most half an fp16 step
        error = numpy.abs((hi + lo) * inv - x).max() / numpy.abs(x).max()
        assert error <= 2.0 ** -22, error
        assert numpy.abs(hi * inv - x).max() / numpy.abs(x).max() > 2.0 ** -14  # the remainder matters


def test_inf_and_nan_are_copied_with_zero_remainders_and_do_not_set_the_scale():
    import cupy
    x = numpy.array([1e5, -numpy.inf, numpy.inf, 0.5, numpy.nan, 3.0, -2.0, 1e-3], numpy.float32)
    ((hi, lo),), inverse = _convert([cupy.asarray(x)])
    hi, lo = cupy.asnumpy(hi).astype(numpy.float64), cupy.asnumpy(lo).astype(numpy.float64)
    assert numpy.isneginf(hi[1]) and numpy.isposinf(hi[2]) and numpy.isnan(hi[4])
    assert (lo[[1, 2, 4]] == 0).all() and numpy.isfinite(lo).all()
    assert inverse[0] == 2.0 ** 3  # from max|x| = 1e5 < 2^17 over the finite elements: s = 2^(14 − 17)
    finite = numpy.isfinite(x)
    assert numpy.abs((hi + lo)[finite] * inverse[0] - x[finite]).max() <= 2.0 ** -22 * 1e5


@pytest.mark.parametrize("shapes", [[(8192, 1024), (4928, 2048)], [(77, 1536), (3, 1024)], [(5, 64), (700, 128)]])
def test_the_copy_pass_writes_partial_column_sums_that_add_up_to_the_column_sums(shapes):
    import cupy
    rng = numpy.random.default_rng(len(shapes[0]) + shapes[0][0])
    tensors = [cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32) + 3) for shape in shapes]
    scaler = HalfScaler(len(tensors), 132)
    table = cupy.array([x.data.ptr for x in tensors], numpy.uint64)
    halves = [cupy.empty(x.size, numpy.float16) for x in tensors]
    sizes, cols = [x.size for x in tensors], [x.shape[1] for x in tensors]
    sums = [cupy.full((rows, c), numpy.nan, numpy.float32) for rows, c in zip(column_sum_rows(sizes, cols, 132), cols)]
    copy, _ = scaler.group(table.data.ptr, [(x.size, h.data.ptr, i, 0, s.data.ptr, x.shape[1])
                                            for i, (x, h, s) in enumerate(zip(tensors, halves, sums))])
    copy()
    for x, s in zip(tensors, sums):
        got = cupy.asnumpy(s)
        assert not numpy.isnan(got).any()  # every partial written
        numpy.testing.assert_allclose(got.astype(numpy.float64).sum(0), cupy.asnumpy(x).astype(numpy.float64).sum(0),
                                      rtol=1e-5, atol=1e-3)


def _window_scales(amax, inverse):
    """The scales a copy and its rescale leave for maxima ``amax`` after a run that left ``inverse``
    (1 / s): the last scale while it puts max|x| within [2^12, 2^15), else 2^(14 − e), max|x| < 2^e."""
    exact = numpy.ldexp(numpy.float32(1), 14 - numpy.frexp(amax)[1]).astype(numpy.float32)
    kept = (amax / inverse >= 2.0 ** 12) & (amax / inverse < 2.0 ** 15)
    return numpy.where(kept, 1 / inverse, exact).astype(numpy.float32)


def test_each_rescale_leaves_every_alpha_right_for_the_next_group_and_run():
    # Two groups of one scaler, over runs whose magnitudes move the scales (the guess wrong: the
    # rescale rewrites) or keep them (the copy stands): half_rescale's block 0 sets the n × n alphas
    # and the next copies' guesses, the copies clear the amax buffers their slots take next. Tensor 1
    # takes several strides of both kernels' grids (all four loads in flight) and a partial one.
    import cupy
    rng = numpy.random.default_rng(11)
    sizes = [1 << 16, 4 * (4 * 2 * 132 * 256 * 3 + 7), 1 << 14]
    base = [rng.standard_normal(size, dtype=numpy.float32) for size in sizes]
    sources = [cupy.empty(size, numpy.float32) for size in sizes]
    halves = [cupy.empty(size, numpy.float16) for size in sizes]
    table = cupy.array([x.data.ptr for x in sources], numpy.uint64)
    scaler = HalfScaler(3, 132)
    members = ([0, 1], [2])
    groups = [scaler.group(table.data.ptr + 8 * m[0], [(sizes[i], halves[i].data.ptr, i, 0, 0, 0) for i in m])
              for m in members]
    alphas = scaler.alphas()
    inverse = numpy.ones(3, numpy.float32)  # a scaler's start
    # Factors of 2 and 1/2 keep the guess (max|x| · s stays within [2^12, 2^15)); 4 or 1/4 do not.
    for exponents in ([0, 0, 0], [0, 0, 0], [5, -3, 0], [6, -4, 1], [5, -3, 0], [5, -3, 12], [-20, 30, 12],
                      [-22, 32, 10], [0, 0, 0]):
        values = [b * numpy.float32(2.0 ** e) for b, e in zip(base, exponents)]
        for x, v in zip(sources, values):
            x.set(v)
        amax = numpy.array([numpy.abs(v).max() for v in values], numpy.float32)
        s = _window_scales(amax, inverse)
        for m, (copy, rescale) in zip(members, groups):
            copy(), rescale()
            inverse[m] = 1 / s[m]  # the other group's slots keep their last scales
            numpy.testing.assert_array_equal(cupy.asnumpy(scaler.inverse_scales()), inverse)
            numpy.testing.assert_array_equal(cupy.asnumpy(alphas), numpy.outer(inverse, inverse))
        for v, h, scale in zip(values, halves, s):
            numpy.testing.assert_array_equal(cupy.asnumpy(h), (v * scale).astype(numpy.float16))


def test_tensors_sharing_a_slot_take_the_scale_of_their_joint_max_run_after_run():
    # As [Wk; Wv] do in the backward: two tensors of one group in one slot (both copies record the
    # slot's scale and amax buffer, the max is over both), a third alone; the amax buffers take turns.
    import cupy
    rng = numpy.random.default_rng(5)
    sizes = [1 << 15, 3 * 1024, 1 << 12]
    base = [rng.standard_normal(size, dtype=numpy.float32) for size in sizes]
    sources = [cupy.empty(size, numpy.float32) for size in sizes]
    halves = [cupy.empty(size, numpy.float16) for size in sizes]
    table = cupy.array([x.data.ptr for x in sources], numpy.uint64)
    scaler = HalfScaler(2, 132)
    slots = [0, 0, 1]
    copy, rescale = scaler.group(table.data.ptr, [(size, h.data.ptr, slot, 0, 0, 0)
                                                  for size, h, slot in zip(sizes, halves, slots)])
    inverse = numpy.ones(2, numpy.float32)
    # The second tensor's max leads the shared slot in some runs, the first's in others.
    for exponents in ([0, 0, 0], [0, 6, -5], [0, 6, -5], [-8, 2, 20], [3, -9, 0], [3, -9, 0]):
        values = [b * numpy.float32(2.0 ** e) for b, e in zip(base, exponents)]
        for x, v in zip(sources, values):
            x.set(v)
        amax = numpy.array([max(numpy.abs(values[0]).max(), numpy.abs(values[1]).max()),
                            numpy.abs(values[2]).max()], numpy.float32)
        s = _window_scales(amax, inverse)
        copy(), rescale()
        inverse = 1 / s
        numpy.testing.assert_array_equal(cupy.asnumpy(scaler.inverse_scales()), inverse)
        numpy.testing.assert_array_equal(cupy.asnumpy(scaler.alphas()), numpy.outer(inverse, inverse))
        for v, h, slot in zip(values, halves, slots):
            numpy.testing.assert_array_equal(cupy.asnumpy(h), (v * s[slot]).astype(numpy.float16))


@pytest.mark.parametrize("parts", [1, 3])
def test_a_tensor_given_as_parts_is_their_sum_in_order_in_the_copy_the_rescale_and_the_column_sums(parts):
    # The attention's dK|dV partials of its query chunks (and dQ's of its key parts), summed by the
    # conversion (no pass of their own): slices `stride` elements apart, added in slice order as
    # attn_sum_parts does.
    import cupy
    rng = numpy.random.default_rng(parts)
    rows, cols, stride = 300, 256, 300 * 256 + 64
    source = cupy.asarray(rng.standard_normal(parts * stride, dtype=numpy.float32) + 3)  # sums far from 0
    table = cupy.array([source.data.ptr], numpy.uint64)
    half, lo = (cupy.full(rows * cols, numpy.nan, numpy.float16) for _ in range(2))
    (sum_rows,) = column_sum_rows([rows * cols], [cols], 132)
    sums = cupy.full((sum_rows, cols), numpy.nan, numpy.float32)
    scaler = HalfScaler(1, 132)
    copy, rescale = scaler.group(table.data.ptr, [(rows * cols, half.data.ptr, 0, lo.data.ptr, sums.data.ptr, cols,
                                                   parts, stride)])
    for factor in (1.0, 2.0 ** 20):  # the second run's scale moves: the rescale rewrites from the parts
        source *= numpy.float32(factor)
        slices = cupy.asnumpy(source).reshape(parts, stride)[:, :rows * cols]
        x = slices[0].copy()
        for part in slices[1:]:
            x += part  # float32, in order
        copy(), rescale()
        inverse = cupy.asnumpy(scaler.inverse_scales())[0]
        scaled = x / inverse  # exact: a power of two
        numpy.testing.assert_array_equal(cupy.asnumpy(half), scaled.astype(numpy.float16))
        # The fp32 mode's remainders, of the sum (another order of addition changes thousands of them).
        remainder = (scaled - scaled.astype(numpy.float16)).astype(numpy.float16)
        numpy.testing.assert_array_equal(cupy.asnumpy(lo), remainder)
        numpy.testing.assert_allclose(cupy.asnumpy(sums).astype(numpy.float64).sum(0),
                                      x.reshape(rows, cols).astype(numpy.float64).sum(0), rtol=1e-5)


@pytest.mark.parametrize("d", [256, 2304])  # 2304: past the pairs the rescale loads at its start
@pytest.mark.parametrize("bias_magnitude", [1.0, 2.0 ** 13, 2.0 ** 16, 2.0 ** 20])
def test_the_rescale_writes_a_gemms_bias_at_its_output_scale_under_2_to_the_15(bias_magnitude, d):
    # The fp16 mode's Q0 = X Wq^T + bq, cuBLASLt adding bq: out = [alpha · 2^-k, s · 2^-k] with
    # s = alpha · s_X · s_Wq, and bias = half(bq · s · 2^-k), k the least that keeps (2^14 + max|bq · s|)
    # · 2^-k under 2^15 (the product's part is under 2^14 · 2^-k by alpha). Two runs: the second's
    # scales move (X times 2^6, Wq times 2^-9: s times 2^3), and so do bias and out. s is near 1
    # here: k = 0 for the smaller biases, k > 0 for the larger.
    import cupy
    rng = numpy.random.default_rng(23)
    alpha = 2.0 ** -24
    x, w = (cupy.asarray(rng.standard_normal(n, dtype=numpy.float32)) for n in (4 * d, d * d))
    bq_host = rng.standard_normal(d).astype(numpy.float32)
    bq_host *= numpy.float32(bias_magnitude / numpy.abs(bq_host).max())
    bq = cupy.asarray(bq_host)
    scaler = HalfScaler(3, 132)
    table = cupy.array([x.data.ptr, w.data.ptr, bq.data.ptr], numpy.uint64)
    halves = [cupy.empty(t.size, numpy.float16) for t in (x, w)]
    bias, out = cupy.full(d, numpy.nan, numpy.float16), cupy.full(2, numpy.nan, numpy.float32)
    copy, rescale = scaler.group(table.data.ptr, [(t.size, h.data.ptr, i + 1, 0, 0, 0) for i, (t, h) in
                                                  enumerate(zip((x, w), halves))],
                                 product_bias=(d, 1, 2, alpha, bias.data.ptr, out.data.ptr))
    for run in range(2):
        if run:
            x *= 2.0 ** 6
            w *= 2.0 ** -9
        copy(), rescale()
        inv = cupy.asnumpy(scaler.inverse_scales()).astype(numpy.float64)
        s = alpha / (inv[1] * inv[2])  # the scale of alpha · (X s_X)(Wq s_Wq)
        k = max(int(numpy.frexp(2.0 ** 14 + numpy.abs(bq_host).max() * s)[1]) - 15, 0)
        assert (k > 0) == (bias_magnitude * s >= 2.0 ** 14)
        numpy.testing.assert_array_equal(cupy.asnumpy(out), numpy.float32([alpha * 2.0 ** -k, s * 2.0 ** -k]))
        numpy.testing.assert_array_equal(cupy.asnumpy(bias), (bq_host * (s * 2.0 ** -k)).astype(numpy.float16))
        assert 2.0 ** (14 - k) + numpy.abs(cupy.asnumpy(bias).astype(numpy.float64)).max() < 2.0 ** 15
