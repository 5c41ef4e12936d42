"""The fused attention kernel alone against the float64 reference attention (marker ``gpu``)."""
import numpy
import pytest

from cupy_xattn import attention_bwd, reference
from cupy_xattn.checks import Problem

pytestmark = pytest.mark.gpu

# Relative max error of O, dQ, dK, dV: TF32 products (10-bit mantissa) vs the 3xTF32 split.
TOLERANCE = {"tf32": 5e-3, "fp16": 5e-3, "fp32": 2e-5}


@pytest.mark.parametrize("precision, o_layout", [("tf32", "rows"), ("tf32", "transposed"), ("tf32", "rows, fp16 K0|V0"),
                                                 ("tf32", "transposed, fp16 K0|V0"), ("tf32", "transposed, dQ^T"),
                                                 ("tf32", "transposed, fp16 K0|V0, dQ^T"), ("fp16", "half"),
                                                 ("fp16", "half, fp16 K0|V0"), ("fp32", "rows"), ("fp32", "half")])
@pytest.mark.parametrize("resident_rows, wgmma", [(64, True), (64, False), (128, False)])  # wgmma: sm_90 only
@pytest.mark.parametrize("batch_size, n_video, n_text", [
    (1, 1, 1), (2, 64, 77), (2, 691, 77), (1, 4096, 77), (8, 256, 373), (1, 100, 512), (3, 33, 31),
    (2, 130, attention_bwd.RESIDENT_MAX_KEYS), (2, 130, attention_bwd.RESIDENT_MAX_KEYS + 1),
    (4, 512, 1), (4, 512, 31), (4, 512, 40), (4, 512, 50),  # grids of 256 blocks: wgmma with 16 to 64 keys
    (2, 853, 93)])  # streamed, one key part, a last 16-row block past Nv (dQ^T's column sums)
def test_attention_kernel_matches_reference(batch_size, n_video, n_text, precision, o_layout, resident_rows, wgmma,
                                            monkeypatch):
    import cupy
    monkeypatch.setattr(attention_bwd, "RESIDENT_BLOCK_Q", resident_rows)
    monkeypatch.setattr(attention_bwd, "WGMMA", wgmma)
    heads, hidden = 16, 1024
    rng = numpy.random.default_rng(n_video * 1000 + n_text)
    q0 = rng.standard_normal((batch_size * n_video, hidden), dtype=numpy.float32)
    kv0 = rng.standard_normal((batch_size * n_text, 2 * hidden), dtype=numpy.float32)
    dout = rng.standard_normal((batch_size * n_video, hidden), dtype=numpy.float32)
    bq, bk, bv = (rng.standard_normal(hidden, dtype=numpy.float32) for _ in range(3))
    problem = Problem(batch_size, n_video, n_text, hidden, heads, 64, 0.125)

    poison = lambda shape: cupy.full(shape, numpy.nan, numpy.float32)  # noqa: E731
    rows = batch_size * n_video
    o_transposed, o_half, kv_half = o_layout.startswith("transposed"), o_layout.startswith("half"), "K0" in o_layout
    dq_transposed = "dQ^T" in o_layout  # dQ^T laid out as O^T, and dQ's column sums by 16 rows of a sample
    o = poison((hidden, attention_bwd.o_t_stride(rows))) if o_transposed else poison(q0.shape)  # tf32's O^T
    o_scales, half_scales, o_lo = None, None, None
    if o_half:  # fp16 O at the scale of a bound on |V|: here 2 · (2 to 4 · max|V0| + 1 to 2 · max|bv|)
        o = o.astype(numpy.float16)
        inv_w = 2.0 ** (numpy.ceil(numpy.log2(numpy.abs(kv0[:, hidden:]).max() / hidden)) - 14)
        inv_bv = 2.0 ** (numpy.ceil(numpy.log2(numpy.abs(bv).max())) - 15)
        if kv_half:  # inv_w as loose as the backward's: [K0 | V0] · s_KV peaks near 2^3, ~2^11 under its bound
            inv_w = attention_bwd.kv_half_alpha(hidden) / (2.0 ** (3 - numpy.ceil(numpy.log2(numpy.abs(kv0).max())))
                                                           * 2.0 ** -15)
        # inv_t, inv_w, inv_bv, inv_dy; inv_o and alpha_o written by the kernel (fp32: two alphas)
        half_scales = cupy.array([2.0 ** -15, inv_w, inv_bv, 2.0 ** -3] + [numpy.nan] * 3, numpy.float32)
        o_scales = tuple(half_scales.data.ptr + 4 * i for i in range(6))
        if precision == "fp32":  # and the remainders (a separate poisoned array)
            o_lo = o.copy()
    dq, dkv = poison(q0.shape), poison(kv0.shape)
    biases = [cupy.asarray(b) for b in (bq, bk, bv)]
    bias_table = cupy.array([b.data.ptr for b in biases], numpy.uint64)
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    if kv_half and not attention_bwd.half_kv(problem, precision, sm_count):
        pytest.skip("an fp32 K0|V0 here (half_kv)")
    if dq_transposed and attention_bwd.launch_layout(problem, precision, sm_count).kv_parts > 1:
        pytest.skip("dQ in key parts here: no dQ^T from the kernel")
    dq_t, dq_sums = poison(o.shape), poison((attention_bwd.dq_sums_rows(batch_size, n_video), hidden))
    kernel = attention_bwd.AttentionBackward(problem, precision, sm_count, o_transposed=o_transposed, o_half=o_half,
                                             kv_half=kv_half, dq_transposed=dq_transposed)
    _poison_partials(kernel)
    kv0_in, kv_scale = cupy.asarray(kv0), None
    if kv_half:  # [K0 | V0] · s_KV in fp16; the reference takes the rounded values
        if o_half:  # fp16 mode: s_KV = alpha / (inv_t · inv_w)
            s_kv = attention_bwd.kv_half_alpha(hidden) / (2.0 ** -15 * inv_w)
        else:  # tf32: 1 / s_KV given, as a conversion at the scale of the max (in [2^12, 2^15)) leaves it
            s_kv = 2.0 ** (13 - numpy.floor(numpy.log2(numpy.abs(kv0).max())))
            kv_scale = cupy.array([1 / s_kv], numpy.float32)
        kv0_in = cupy.asarray(kv0 * s_kv).astype(numpy.float16)
        kv0 = (cupy.asnumpy(kv0_in).astype(numpy.float64) / s_kv).astype(numpy.float32)
        assert 2.0 ** (2 if o_half else 13) <= numpy.abs(kv0).max() * s_kv <= 2.0 ** (3 if o_half else 14)
    kernel(cupy.asarray(q0), kv0_in, bias_table.data.ptr, cupy.asarray(dout), o, dq, dkv,
           o_scales=o_scales, o_lo=None if o_lo is None else o_lo.data.ptr,
           kv_scale=None if kv_scale is None else kv_scale.data.ptr,
           dq_t=dq_t.data.ptr if dq_transposed else None, dq_sums=dq_sums.data.ptr if dq_transposed else None)
    if dq_transposed:  # dQ^T holds dQ's bits, its padding columns are left alone; the sums are of dQ's rows
        got_dq_t = cupy.asnumpy(dq_t)
        assert numpy.array_equal(got_dq_t[:, :rows].T, cupy.asnumpy(dq)) and numpy.isnan(got_dq_t[:, rows:]).all()
        blocks = -(-n_video // 16)
        padded = numpy.zeros((batch_size, blocks * 16, hidden))
        padded[:, :n_video] = cupy.asnumpy(dq).reshape(batch_size, n_video, hidden)
        want = padded.reshape(batch_size * blocks, 16, hidden).sum(axis=1)
        got = cupy.asnumpy(dq_sums)  # fp32 sums of 16: within 16 roundings of the largest element
        assert numpy.abs(got - want).max() <= 1e-5 * numpy.abs(padded).max() + 1e-30, numpy.abs(got - want).max()

    f64 = lambda a, n: a.astype(numpy.float64).reshape(batch_size, n, -1)  # noqa: E731
    q = f64(q0, n_video) + bq
    k = f64(kv0[:, :hidden], n_text) + bk
    v = f64(kv0[:, hidden:], n_text) + bv
    do = f64(dout, n_video)
    ref_o = reference.attention(q, k, v, 0.125, num_heads=heads)
    ref_dq, ref_dk, ref_dv = reference.attention_backward(do, q, k, v, 0.125, num_heads=heads)
    got_dkv = cupy.asnumpy(dkv).reshape(batch_size, n_text, 2 * hidden)
    got_o = cupy.asnumpy(o)[:, :rows].T if o_transposed else cupy.asnumpy(o)
    if o_half:  # inv_o = 1 / s_O, s_O = 2^(14 − e) for the bound < 2^e (the kernel's float32 arithmetic)
        bound = numpy.float32(2) * numpy.float32(hidden * 2.0 ** 30 * 2.0 ** -15 * inv_w + 2.0 ** 15 * inv_bv)
        inv_o, alpha_o, alpha_lo = cupy.asnumpy(half_scales)[4:]
        assert inv_o == 2.0 ** (numpy.frexp(bound)[1] - 14) and alpha_o == inv_o * 2.0 ** -3, (inv_o, alpha_o, bound)
        assert alpha_lo == alpha_o * 2.0 ** -11 if o_lo is not None else numpy.isnan(alpha_lo), alpha_lo
        assert numpy.abs(got_o.astype(numpy.float64)).max() < 2.0 ** 14
        got_o = got_o.astype(numpy.float64) * inv_o
        if o_lo is not None:  # without the remainders (at 2^11 times O's scale), O would be off by up to 2^-12
            got_o += cupy.asnumpy(o_lo).astype(numpy.float64) * inv_o * 2.0 ** -11
    pairs = {"O": (got_o, ref_o), "dQ": (cupy.asnumpy(dq), ref_dq),
             "dK": (got_dkv[..., :hidden], ref_dk), "dV": (got_dkv[..., hidden:], ref_dv)}
    scale_dq = numpy.abs(ref_dv).max()  # dQ and dK are exactly 0 when n_text = 1
    errors = {}
    for name, (got, ref) in pairs.items():
        size = max(numpy.abs(ref).max(), 1e-9 * scale_dq) if n_text > 1 else scale_dq
        errors[name] = float(numpy.abs(got.reshape(ref.shape) - ref).max() / size)
    assert all(e <= TOLERANCE[precision] for e in errors.values()), errors


def _poison_partials(kernel):
    """NaN in the kernel's own dK/dV and dQ partials (where it has them), which the reduction adds
    into dkv and dq: an element the kernel leaves unwritten comes out NaN."""
    import cupy
    for parts in (kernel.partials, kernel.dq_partials):
        if parts is not None:
            parts.fill(cupy.nan)


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_streamed_key_parts_match_one_part_and_the_reference(precision, monkeypatch):
    # 3 × 70 video, 145 text tokens (5 key tiles), 8 heads: 48 blocks of the streamed kernel (one
    # query tile each), with two key parts 96, with five 240. Texts of 145, 33 and 1 keys: with five
    # parts part 0 has no key tile of pass 2 (pass2_tile), nor parts 1 and 3 for the second sample;
    # with two, part 0 none for the last. O, dK and dV come out the same bits with one part or more
    # (the same products at the same scales: a part's pass 2 starts its K scale history at its first
    # tile, which matters only where one key tile's max is ~2^30 times a later one's); dQ, a sum of
    # parts, within rounding; all match the reference, and padded keys' dK, dV rows are 0.
    import cupy
    batch_size, n_video, n_text, heads, hidden = 3, 70, 145, 8, 512
    rng = numpy.random.default_rng(2024)
    q0 = rng.standard_normal((batch_size * n_video, hidden), dtype=numpy.float32)
    kv0 = rng.standard_normal((batch_size * n_text, 2 * hidden), dtype=numpy.float32)
    dout = rng.standard_normal((batch_size * n_video, hidden), dtype=numpy.float32)
    bq, bk, bv = (rng.standard_normal(hidden, dtype=numpy.float32) for _ in range(3))
    lengths = numpy.array([145, 33, 1], numpy.int32)
    problem = Problem(batch_size, n_video, n_text, hidden, heads, 64, 0.125)
    biases = [cupy.asarray(b) for b in (bq, bk, bv)]
    bias_table = cupy.array([b.data.ptr for b in biases], numpy.uint64)
    results = {}
    for parts in (1, 2, 5):
        monkeypatch.setattr(attention_bwd, "STREAMED_KV_PARTS", parts)
        kernel = attention_bwd.AttentionBackward(problem, precision, 132)
        assert kernel.kv_parts == parts and kernel.n_chunks == 2
        _poison_partials(kernel)
        o, dq, dkv = (cupy.full(a.shape, numpy.nan, numpy.float32) for a in (q0, q0, kv0))
        kernel(cupy.asarray(q0), cupy.asarray(kv0), bias_table.data.ptr, cupy.asarray(dout), o, dq, dkv,
               cupy.asarray(lengths))
        results[parts] = [cupy.asnumpy(a) for a in (o, dq, dkv)]
    (o1, dq1, dkv1), (o2, dq2, dkv2), (o5, dq5, dkv5) = results[1], results[2], results[5]
    assert all(numpy.array_equal(o1, o) and numpy.array_equal(dkv1, dkv) for o, dkv in ((o2, dkv2), (o5, dkv5)))

    f64 = lambda a, n: a.astype(numpy.float64).reshape(batch_size, n, -1)  # noqa: E731
    q, do = f64(q0, n_video) + bq, f64(dout, n_video)
    k, v = f64(kv0[:, :hidden], n_text) + bk, f64(kv0[:, hidden:], n_text) + bv
    ref_o = reference.attention(q, k, v, 0.125, num_heads=heads, text_lengths=lengths)
    ref_dq, ref_dk, ref_dv = reference.attention_backward(do, q, k, v, 0.125, num_heads=heads, text_lengths=lengths)
    dkv2 = dkv2.reshape(batch_size, n_text, 2 * hidden)
    for sample, n_keys in enumerate(lengths):
        assert not dkv2[sample, n_keys:].any()
    errors = {name: float(numpy.abs(got.reshape(ref.shape) - ref).max() / numpy.abs(ref).max())
              for name, got, ref in (("O", o2, ref_o), ("dQ one part", dq1, ref_dq), ("dQ", dq2, ref_dq),
                                     ("dQ five parts", dq5, ref_dq),
                                     ("dK", dkv2[..., :hidden], ref_dk), ("dV", dkv2[..., hidden:], ref_dv))}
    assert all(e <= TOLERANCE[precision] for e in errors.values()), errors


O_BYTES = 2 * 64 * 1024  # the fp16 O of the problem below


@pytest.mark.parametrize("precision, o_lo_offset, match", [
    ("fp32", None, "o_lo"), ("fp16", O_BYTES, "o_lo"), ("fp32", O_BYTES + 6, "multiple of 8"),
    ("fp32", O_BYTES - 8, "overlaps"), ("fp32", 8 - O_BYTES, "overlaps"), ("fp32", 0, "overlaps"),
    ("fp32", O_BYTES, None), ("fp32", -O_BYTES, None)])  # None: accepted, O's neighbours either side
def test_o_remainders_go_with_the_fp32_mode_fp16_o(precision, o_lo_offset, match):
    import cupy
    problem = Problem(1, 64, 77, 1024, 16, 64, 0.125)
    kernel = attention_bwd.AttentionBackward(problem, precision, 132, o_half=True)
    f32 = lambda *shape: cupy.zeros(shape, numpy.float32)  # noqa: E731
    # O is the middle third of one buffer: a remainder a check let through is written inside it.
    thirds = cupy.zeros((3, 64, 1024), numpy.float16)
    o = thirds[1]
    bias = f32(1024)
    biases = cupy.array([bias.data.ptr] * 3, numpy.uint64)
    scales = cupy.array([2.0 ** -15] * 3 + [1.0] + [numpy.nan] * 3, numpy.float32)  # inv_o, two alphas written
    call = lambda: kernel(f32(64, 1024), f32(77, 2048), biases.data.ptr, f32(64, 1024), o, f32(64, 1024),  # noqa: E731
                          f32(77, 2048), o_scales=tuple(scales.data.ptr + 4 * i for i in range(6)),
                          o_lo=None if o_lo_offset is None else o.data.ptr + o_lo_offset)
    if match is None:
        call()
        cupy.cuda.Device().synchronize()
        assert not bool(cupy.isnan(thirds).any())  # zeros in, zeros out: O and its remainder
        return
    with pytest.raises(ValueError, match=match):
        call()


# The resident kernel, the resident kernel with its keys split (128 blocks: one tile an SM), the streamed kernel.
@pytest.mark.parametrize("batch_size, n_video, n_text", [(1, 4096, 77), (2, 256, 77), (2, 256, 211)])
@pytest.mark.parametrize("magnitudes", ["tiny gradients", "huge gradients", "huge and tiny operands", "tiny Q, huge K",
                                        "tiny Q and K", "tiles apart", "huge padding", "a zero value tile",
                                        "a value tile 2^16 up"])
def test_attention_operand_scales_follow_the_magnitudes(batch_size, n_video, n_text, magnitudes):
    # The tf32/fp16 build stores operand tiles as fp16 scaled by powers of two chosen per tile
    # (attention_common.cuh): gradients of 1e-31 would vanish in plain fp16, Q of 1e5 overflow it;
    # the products are unscaled under CuPy's -ftz=true without flushing (1e-31, Q of 1e-34) or
    # overflowing (1e34) midway; Q and K of 1e-20 flush the scores' factor to log2 units to 0
    # (the scores are ~0 either way), and a padded key must still count as −∞, not as 0 · −∞ =
    # NaN (what the factor inside exp2's argument gave, Session 41); tiles of dO and V 2^40 and
    # 2^12 apart make the tiles' scales differ, so the dK, dV, O and dQ accumulators change scale
    # between tiles; keys past a sample's text length of 1e12 must not set the scale of the rest.
    # dS's scale comes from a bound through max|V| over all keys (D sums over them): a key tile of
    # V = 0, or one 2^16 above the rest, must not let another tile's dS overflow fp16 (the streamed
    # kernel's per-tile V scale did).
    # The other cases keep the scores at their usual size: a much sharper softmax would make dQ and dK
    # ill-conditioned in any precision (which key wins flips with the rounding of S).
    import cupy
    heads, hidden = 16, 1024
    rng = numpy.random.default_rng(7)
    q0 = rng.standard_normal((batch_size * n_video, hidden), dtype=numpy.float32)
    kv0 = rng.standard_normal((batch_size * n_text, 2 * hidden), dtype=numpy.float32)
    dout = rng.standard_normal((batch_size * n_video, hidden), dtype=numpy.float32)

    def spread(a, tile, octaves):  # a factor per tile of rows, and rows within a tile ±1 octave apart
        exponents = numpy.repeat(rng.uniform(*octaves, -(-len(a) // tile)), tile)[:len(a)] + rng.uniform(-1, 1, len(a))
        a *= numpy.exp2(exponents).astype(numpy.float32)[:, None]

    lengths = numpy.full(batch_size, n_text, numpy.int32)
    if magnitudes == "tiny gradients":
        dout *= numpy.float32(1e-31)
    elif magnitudes == "huge gradients":
        dout *= numpy.float32(1e34)
    elif magnitudes == "tiny Q, huge K":
        q0 *= numpy.float32(1e-34)
        kv0[:, :hidden] *= numpy.float32(1e34)
    elif magnitudes == "tiny Q and K":
        q0 *= numpy.float32(1e-20)
        kv0[:, :hidden] *= numpy.float32(1e-20)
    elif magnitudes == "huge and tiny operands":
        q0 *= numpy.float32(2.0 ** 17)
        kv0[:, :hidden] *= numpy.float32(2.0 ** -17)
        kv0[:, hidden:] *= numpy.float32(2.0 ** 20)
    elif magnitudes == "a zero value tile":
        kv0.reshape(batch_size, n_text, 2 * hidden)[:, 32:64, hidden:] = 0  # the streamed kernel's second key tile
    elif magnitudes == "a value tile 2^16 up":
        kv0.reshape(batch_size, n_text, 2 * hidden)[:, :32, hidden:] *= numpy.float32(2.0 ** 16)
    elif magnitudes == "tiles apart":
        spread(dout, 64, (-30, 10))
        spread(q0, 64, (-2, 0))
        spread(kv0[:, hidden:], 32, (-8, 4))
    else:
        lengths[0] = n_text - 20
        kv0[lengths[0]:n_text] *= numpy.float32(1e12)
    zero = numpy.zeros(hidden, numpy.float32)
    problem = Problem(batch_size, n_video, n_text, hidden, heads, 64, 0.125)
    o, dq, dkv = (cupy.full(a.shape, numpy.nan, numpy.float32) for a in (q0, q0, kv0))
    biases = [cupy.asarray(zero) for _ in range(3)]
    bias_table = cupy.array([b.data.ptr for b in biases], numpy.uint64)
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    kernel = attention_bwd.AttentionBackward(problem, "tf32", sm_count)
    _poison_partials(kernel)
    kernel(cupy.asarray(q0), cupy.asarray(kv0), bias_table.data.ptr, cupy.asarray(dout), o, dq, dkv,
           cupy.asarray(lengths))

    f64 = lambda a, n: a.astype(numpy.float64).reshape(batch_size, n, -1)  # noqa: E731
    q, do = f64(q0, n_video), f64(dout, n_video)
    k, v = f64(kv0[:, :hidden], n_text), f64(kv0[:, hidden:], n_text)
    ref_o = reference.attention(q, k, v, 0.125, num_heads=heads, text_lengths=lengths)
    ref_dq, ref_dk, ref_dv = reference.attention_backward(do, q, k, v, 0.125, num_heads=heads, text_lengths=lengths)
    # Componentwise error bounds: each result element against the sum of the magnitudes of the
    # terms it adds up, |A|·|B|; for dS = P ∘ (dP − D)·scale the terms are P·(|dP| + |D|)·scale.
    # Rounding the operands to 11 significant bits (TF32 or fp16) gives errors of a few 2^-11 of that.
    split = lambda a: a.reshape(batch_size, -1, heads, 64).swapaxes(1, 2)  # noqa: E731
    merge = lambda a: a.swapaxes(1, 2).reshape(batch_size, a.shape[2], hidden)  # noqa: E731
    qh, kh, vh, doh = map(split, (q, k, v, do))
    p = reference.attention_probabilities(q, k, 0.125, num_heads=heads, text_lengths=lengths)
    dp = doh @ vh.swapaxes(-1, -2)
    terms = 0.125 * p * (numpy.abs(dp) + numpy.abs((p * dp).sum(axis=-1, keepdims=True)))
    bounds = {"O": p @ numpy.abs(vh), "dQ": terms @ numpy.abs(kh), "dK": terms.swapaxes(-1, -2) @ numpy.abs(qh),
              "dV": p.swapaxes(-1, -2) @ numpy.abs(doh)}
    got_dkv = cupy.asnumpy(dkv).reshape(batch_size, n_text, 2 * hidden)
    got = {"O": cupy.asnumpy(o), "dQ": cupy.asnumpy(dq), "dK": got_dkv[..., :hidden], "dV": got_dkv[..., hidden:]}
    refs = {"O": ref_o, "dQ": ref_dq, "dK": ref_dk, "dV": ref_dv}
    errors = {}
    for name, ref in refs.items():
        result = got[name].reshape(ref.shape)
        assert numpy.isfinite(result).all(), name
        error, bound = numpy.abs(result - ref), merge(bounds[name])  # bound 0: padded keys' dK, dV rows are 0
        errors[name] = float(numpy.where(bound > 0, error / numpy.where(bound > 0, bound, 1), (error > 0) * 1e9).max())
    assert all(e <= 1e-2 for e in errors.values()), errors  # about 20 roundings
