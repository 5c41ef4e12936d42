"""The CuPy backend on a GPU, against the float64 reference (marker ``gpu``)."""
import functools
import hashlib

import numpy
import pytest

from cupy_xattn import cases, cross_attention_backward, reference
from cupy_xattn.grads import CrossAttentionGrads

pytestmark = pytest.mark.gpu

PRECISIONS = ("fp32", "tf32", "fp16")
SUITE = cases.load_suite("sol-execbench")
# Relative max error (max|x - y| / max|y|) each mode must stay under on the edge shapes.
EDGE_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2}


def _cupy():
    import cupy
    return cupy


@functools.lru_cache(maxsize=2)
def _case_data(case, seed, hidden_size=1024, num_heads=16):
    inputs = cases.make_inputs(case, hidden_size=hidden_size, seed=seed)
    return inputs, reference.backward(**inputs, num_heads=num_heads)


def _on_gpu(inputs):
    cupy = _cupy()
    return {name: cupy.asarray(array) for name, array in inputs.items()}


def _relative_errors(got, ref):
    """max|x − y| / max|y| per output.

    An output whose reference is zero up to rounding (grad_key_bias always; dQ and dK when
    Nt = 1) is measured against max|grad_value_bias| instead.
    """
    fallback = numpy.abs(ref.grad_value_bias).max()
    errors = {}
    for name, x, y in zip(CrossAttentionGrads._fields, got, ref):
        x = _cupy().asnumpy(x) if not isinstance(x, numpy.ndarray) else x
        size = numpy.abs(y).max()
        size = fallback if name == "grad_key_bias" or size < 1e-9 * fallback else size
        errors[name] = float(numpy.abs(x.astype(numpy.float64) - y).max() / size)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("case", SUITE, ids=[c.label for c in SUITE])
def test_suite_case_passes_the_benchmark_rule_in_every_precision(case, seed):
    # One float64 reference per (case, seed), checked against all three modes.
    inputs, ref = _case_data(case, seed)
    gpu_inputs = _on_gpu(inputs)
    failed = {}
    for precision in PRECISIONS:
        got = cross_attention_backward(**gpu_inputs, precision=precision)
        rows = cases.compare(got, ref, atol=case.atol, rtol=case.rtol, match_ratio=case.match_ratio)
        failed[precision] = [row for row in rows if not row["passed"]]
    assert not any(failed.values()), f"{case.label} seed {seed}: {failed}"


#: fp32's bound (max relative error of any output): its split GEMMs leave the tensor cores' fp32
#: accumulation error, ~1e-6 to 2e-5 on the suite with 3xFP16 (docs/accuracy.md), ~1e-3 for tf32.
FP32_ERROR = 5e-5


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", [SUITE[0], SUITE[5], SUITE[6]], ids=lambda c: c.label)
def test_error_against_the_naive_composition(case, precision):
    # At most twice the error of the same precision composed from plain CuPy calls, output by
    # output; in fp32 (3xFP16 against the naive FFMA) every output that passes through a split
    # product gets FP32_ERROR instead (a product left in plain fp16 gives ~1e-4 to 1e-3), and
    # dbo = column sums of dY, FFMA in both, keeps the rule.
    from cupy_xattn import naive
    inputs, ref = _case_data(case, 21)
    gpu_inputs = _on_gpu(inputs)
    ours = _relative_errors(cross_attention_backward(**gpu_inputs, precision=precision), ref)
    baseline = _relative_errors(naive.backward(gpu_inputs, precision=precision), ref)
    # A floor of 1e-6 keeps outputs summed in fp32 in both (bias gradients) from failing on noise.
    bound = {name: 2 * baseline[name] + 1e-6 if precision != "fp32" or name == "grad_output_bias" else FP32_ERROR
             for name in ours}
    worse = {name: (ours[name], baseline[name]) for name in ours if not ours[name] <= bound[name]}
    assert not worse, f"(ours, naive) relative errors: {worse}"


EDGE_SHAPES = [(1, 1, 77), (2, 64, 1), (1, 256, 512), (1, 691, 77), (2, 853, 93), (1, 1023, 211),
               (1, 4097, 77), (3, 130, 33)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_edge_shapes(shape, precision):
    case = cases.Case(*shape, atol=0.0)
    inputs, ref = _case_data(case, 5)
    errors = _relative_errors(cross_attention_backward(**_on_gpu(inputs), precision=precision), ref)
    bad = {k: v for k, v in errors.items() if not v <= EDGE_TOLERANCE[precision]}
    assert not bad, bad


@pytest.mark.parametrize("factor", [2.0 ** -30, 2.0 ** -12, 2.0 ** 20], ids=["tiny", "small", "huge"])
def test_fp16_mode_rescales_gradients_outside_the_unscaled_range(factor):
    # Every gradient is linear in dY. Scaled by 2^-30 they would vanish in fp16 (smallest
    # subnormal 2^-24), by 2^-12 they would lose bits to subnormals, by 2^20 they would overflow
    # (max 65504): the fp16 copies must be rescaled, and the error relative to each output's
    # size must stay that of unit-sized data.
    case = cases.Case(2, 130, 77, atol=0.0)
    inputs, ref = _case_data(case, 8)
    inputs = dict(inputs, grad_output=inputs["grad_output"] * numpy.float32(factor))
    ref = CrossAttentionGrads(*(r * factor for r in ref))
    errors = _relative_errors(cross_attention_backward(**_on_gpu(inputs), precision="fp16"), ref)
    bad = {k: v for k, v in errors.items() if not v <= EDGE_TOLERANCE["fp16"]}
    assert not bad, bad


def test_fp16_mode_keeps_the_precision_of_a_sample_far_smaller_than_the_others():
    # dY of sample 1 is 2^-20 times that of sample 0 (per-sample loss weights): one scale per
    # tensor must still keep sample 1's values in fp16's normal range.
    case = cases.Case(2, 130, 77, atol=0.0)
    inputs, _ = _case_data(case, 9)
    grad_output = inputs["grad_output"].copy()
    grad_output[1] *= numpy.float32(2.0 ** -20)
    inputs = dict(inputs, grad_output=grad_output)
    ref = reference.backward(**inputs, num_heads=16)
    got = cross_attention_backward(**_on_gpu(inputs), precision="fp16")
    for name in ("grad_video_latents", "grad_text_embeddings"):
        x, y = _cupy().asnumpy(getattr(got, name)[1]), getattr(ref, name)[1]
        assert numpy.abs(x - y).max() / numpy.abs(y).max() <= EDGE_TOLERANCE["fp16"], name


@pytest.mark.parametrize("precision, n_video, n_text, kv_half", [
    ("fp16", 130, 77, True), ("fp16", 130, 93, True), ("fp16", 2048, 77, False), ("tf32", 130, 77, False),
    ("tf32", 130, 93, True), ("fp32", 130, 77, False), ("fp32", 130, 93, False)],
    ids=["fp16-resident", "fp16-streamed", "fp16-resident-long", "tf32-resident", "tf32-streamed", "fp32-resident",
         "fp32-streamed"])
def test_one_k0_v0_scale_keeps_a_sample_whose_text_is_far_below_the_others(precision, n_video, n_text, kv_half):
    # The fp16 [K0 | V0] (kv_half: attention_bwd.half_kv) has one scale for the whole tensor: a sample
    # whose text embeddings are 2^-16 times the others' has its K0 and V0 near fp16's subnormals
    # (fp16 mode: the scale comes from a bound ~2^11 above max|K0|). Its video latents and dY are
    # 2^16 times the others', so that its scores, dS and dQ stay within 2^16 of sample 0's (every
    # other fp16 copy holds both samples at one scale too). scripts/kv_half_range.py's model:
    # ~1.2e-3 in the attention gradients; dX goes through dQ = dS K, dT through dK and dV.
    # Where K0 and V0 come in fp32 (not kv_half: fp16 at 2048 video tokens, blocks of four query
    # tiles on 132 SMs, but for the lean kernel on sm_90a, half_qdo; tf32 at Nt = 77; fp32) bk and
    # bv, left out of the tiles, must not swamp them (attention_bwd.cu): with them, tf32's dX of
    # sample 1 was off by 3.7e3. The lean kernel's fp16 Q0 and dO have one scale each too.
    import cupy
    from cupy_xattn import attention_bwd
    from cupy_xattn.checks import Problem
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    problem = Problem(2, n_video, n_text, 1024, 16, 64, 0.125)
    kv_half = kv_half or attention_bwd.half_qdo(problem, precision, sm_count)
    assert attention_bwd.half_kv(problem, precision, sm_count) == kv_half
    case = cases.Case(2, n_video, n_text, atol=0.0)
    inputs, _ = _case_data(case, 10)
    inputs = {name: array.copy() for name, array in inputs.items()}
    inputs["text_embeddings"][1] *= numpy.float32(2.0 ** -16)
    inputs["video_latents"][1] *= numpy.float32(2.0 ** 16)
    inputs["grad_output"][1] *= numpy.float32(2.0 ** 16)
    ref = reference.backward(**inputs, num_heads=16)
    got = cross_attention_backward(**_on_gpu(inputs), precision=precision)
    for name in ("grad_video_latents", "grad_text_embeddings"):
        for b in (0, 1):
            x, y = _cupy().asnumpy(getattr(got, name)[b]), getattr(ref, name)[b]
            assert numpy.abs(x - y).max() / numpy.abs(y).max() <= 5e-3, (name, b)


def test_the_lean_kernels_q_tile_stays_finite_where_bq_dwarfs_x_wq():
    # The fp16 mode's lean attention (attention_bwd.half_qdo) gets Q0 + bq as fp16 from Q0's GEMM at
    # a scale from a bound on X Wq^T alone: with X 2^-14 times the benchmark's, bq · s_Q would pass
    # fp16's 65504 unless the rescale that writes bq's fp16 copy shifts both down (half_scaling.cu's
    # write_product_bias).
    case = cases.Case(2, 130, 77, atol=0.0)
    inputs, _ = _case_data(case, 11)
    inputs = {name: array.copy() for name, array in inputs.items()}
    inputs["video_latents"] *= numpy.float32(2.0 ** -14)
    ref = reference.backward(**inputs, num_heads=16)
    got = cross_attention_backward(**_on_gpu(inputs), precision="fp16")
    assert all(_cupy().isfinite(x).all() for x in got)
    errors = _relative_errors(got, ref)
    assert max(errors.values()) <= 5e-3, errors


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
@pytest.mark.parametrize("factor", [2.0, 2.0 ** 6, 2.0 ** -12])
def test_the_lean_kernels_ds_scale_follows_query_tiles_far_larger_or_smaller_than_the_blocks_first(precision,
                                                                                                    factor):
    # attn_bwd_lean stores each query tile's dS at a scale from |dP|, and dK^T sums the tiles of a
    # block at the latest one (ds_run): every other 64-row tile of dY here is 2 (2^6, 2^-12) times the
    # rest, so the scale moves up and down from tile to tile within a block (1x4096x77: blocks of
    # four tiles, pinned below; tf32's lean_tf32 takes the same blocks). At 2, a design that stores a
    # tile at the last tile's scale (Session 32's ds-late, perf-notes) would be at |dS · s| just under
    # 2^15. dX's rows depend on
    # their own tile's dS only, so each half of them is checked against its own size: a tile's dS
    # stored at a wrong scale shows there even where it is 2^-12 of the whole output.
    import cupy
    from cupy_xattn import attention_bwd
    from cupy_xattn.checks import Problem
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    problem = Problem(1, 4096, 77, 1024, 16, 64, 0.125)
    layout = attention_bwd.launch_layout(problem, precision, sm_count)
    lean = (attention_bwd.half_qdo(problem, precision, sm_count) if precision == "fp16"
            else attention_bwd.lean_tf32(problem, layout, sm_count))
    if not (lean and layout.tiles_per_chunk > 1):
        pytest.skip("not attn_bwd_lean on blocks of several query tiles here")
    case = cases.Case(1, 4096, 77, atol=0.0)
    inputs, _ = _case_data(case, 14)
    inputs = {name: array.copy() for name, array in inputs.items()}
    tiles = inputs["grad_output"].reshape(1, -1, 128, 1024)  # pairs of 64-row tiles
    tiles[:, :, 64:] *= numpy.float32(factor)
    ref = reference.backward(**inputs, num_heads=16)
    got = cross_attention_backward(**_on_gpu(inputs), precision=precision)
    assert all(_cupy().isfinite(x).all() for x in got)
    errors = _relative_errors(got, ref)
    assert max(errors.values()) <= EDGE_TOLERANCE[precision], errors
    dx, dx_ref = (x.reshape(1, -1, 128, 1024) for x in (_cupy().asnumpy(got.grad_video_latents), ref.grad_video_latents))
    for rows in (slice(0, 64), slice(64, 128)):  # the unscaled tiles, the scaled ones
        y = dx_ref[:, :, rows]
        assert numpy.abs(dx[:, :, rows] - y).max() / numpy.abs(y).max() <= 5e-3, rows


# dWo's bounds: measured (H200, 2026-11-30) fp16 3.1e-4; fp32 1.3e-6 at e = 12 (6.1e-5 before O's
# remainder had a scale of its own), 8.7e-6 at e = 20 (1.4e-4 at e = 24).
@pytest.mark.parametrize("precision, exponent, dwo_bound, n_text", [("fp16", 12, 1e-3, 77), ("fp32", 12, 5e-6, 77),
                                                                    ("fp32", 20, 3e-5, 77), ("fp16", 12, 1e-3, 93)])
def test_half_modes_keep_o_accurate_with_padded_text_rows_far_larger_than_the_rest(precision, exponent, dwo_bound,
                                                                                   n_text):
    # The fp16 O's scale comes from a bound through max|T|, which counts padded rows that never
    # reach O: here 2^e times the others, so the bound is ~2^(12 + e) above max|O| (~2^12 without
    # them). At e = 12 O's fp16 copy peaks near 2^-10, still in fp16's normal range (from 2^-14):
    # dWo keeps its usual error (fp16 ~4e-4). fp32's remainders, stored at 2^11 times O's scale,
    # stay normal there too; at e = 20 O's copy is subnormal (fp16's dWo would be off by ~1e-2,
    # README) and the remainder holds what it loses, to ~2^-18 of max|O|. fp16 with 93 keys: the
    # streamed kernel, whose fp16 [K0 | V0] has a scale from the same kind of bound.
    case = cases.Case(2, 130, n_text, atol=0.0)
    inputs, _ = _case_data(case, 4)
    text = inputs["text_embeddings"].copy()
    text[0, 40:] *= numpy.float32(2.0 ** exponent)
    inputs = dict(inputs, text_embeddings=text)
    lengths = (40, n_text)
    ref = reference.backward(**inputs, num_heads=16, text_lengths=numpy.array(lengths))
    errors = _relative_errors(cross_attention_backward(**_on_gpu(inputs), precision=precision, text_lengths=lengths),
                              ref)
    bad = {k: v for k, v in errors.items() if not v <= EDGE_TOLERANCE[precision]}
    assert not bad, bad
    assert errors["grad_output_weight"] <= dwo_bound, errors


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape, lengths", [((2, 130, 77), (40, 77)), ((2, 70, 93), (1, 93)),
                                            ((3, 64, 211), (211, 100, 33)), ((2, 70, 300), (1, 250))],
                         ids=["resident", "streamed", "3-samples", "streamed-300"])  # 300: 64-key tiles (tf32, fp16)
def test_text_lengths_pad_the_text(shape, lengths, precision):
    inputs, plain_ref = _case_data(cases.Case(*shape, atol=0.0), 4)
    ref = reference.backward(**inputs, num_heads=16, text_lengths=numpy.array(lengths))
    gpu_inputs = _on_gpu(inputs)
    got = cross_attention_backward(**gpu_inputs, precision=precision, text_lengths=lengths)
    errors = _relative_errors(got, ref)
    bad = {k: v for k, v in errors.items() if not v <= EDGE_TOLERANCE[precision]}
    assert not bad, bad
    grad_text = _cupy().asnumpy(got.grad_text_embeddings)
    assert all(not grad_text[b, n:].any() for b, n in enumerate(lengths)), "padded text tokens get zero gradients"
    # The same (cached) plan without lengths attends to every text token again.
    errors = _relative_errors(cross_attention_backward(**gpu_inputs, precision=precision), plain_ref)
    bad = {k: v for k, v in errors.items() if not v <= EDGE_TOLERANCE[precision]}
    assert not bad, bad


def test_float16_activations_give_float16_gradients_of_float32_accuracy():
    # The work is float32 on the fp16 values: compared with the reference on those same values.
    inputs, _ = _case_data(cases.Case(2, 130, 77, atol=0.0), 10)
    half = {name: a.astype(numpy.float16) if a.ndim == 3 else a for name, a in inputs.items()}
    ref = reference.backward(**half, num_heads=16)
    got = cross_attention_backward(**_on_gpu(half), precision="fp32")
    for name, grad in zip(CrossAttentionGrads._fields, got):
        assert grad.dtype == half[name.removeprefix("grad_")].dtype, name
    errors = _relative_errors([g.astype(numpy.float32) for g in got], ref)
    bad = {k: v for k, v in errors.items() if not v <= 2e-3}  # fp16 rounding of dX, dT (2^-11)
    assert not bad, bad


@pytest.mark.parametrize("precision, n_text, heads", [("fp32", 50, 8), ("fp16", 93, 15), ("fp16", 50, 15)])
def test_other_head_counts_with_head_dim_64(precision, n_text, heads):
    # fp16 at D = 960: the fp16 K0|V0's alpha and scale round log2 D up (attention_bwd.kv_half_alpha)
    case = cases.Case(2, 100, n_text, atol=0.0)
    inputs, ref = _case_data(case, 6, hidden_size=64 * heads, num_heads=heads)
    got = cross_attention_backward(**_on_gpu(inputs), num_heads=heads, precision=precision)
    errors = _relative_errors(got, ref)
    assert max(errors.values()) < EDGE_TOLERANCE[precision], errors


@pytest.mark.parametrize("precision", PRECISIONS)
def test_text_lengths_pad_the_text_at_head_dim_128(precision):
    # head_dim 128 streams; length 1 leaves two whole key tiles of 93 keys to skip.
    lengths = (1, 60)
    inputs, _ = _case_data(cases.Case(2, 70, 93, atol=0.0), 4, hidden_size=256, num_heads=2)
    ref = reference.backward(**inputs, num_heads=2, text_lengths=numpy.array(lengths))
    got = cross_attention_backward(**_on_gpu(inputs), num_heads=2, precision=precision, text_lengths=lengths)
    errors = _relative_errors(got, ref)
    bad = {k: v for k, v in errors.items() if not v <= EDGE_TOLERANCE[precision]}
    assert not bad, bad
    grad_text = _cupy().asnumpy(got.grad_text_embeddings)
    assert all(not grad_text[b, n:].any() for b, n in enumerate(lengths)), "padded text tokens get zero gradients"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(2, 100, 50), (1, 70, 130)], ids=lambda s: "x".join(map(str, s)))
def test_head_dim_128(shape, precision):
    inputs, ref = _case_data(cases.Case(*shape, atol=0.0), 7, hidden_size=256, num_heads=2)
    errors = _relative_errors(cross_attention_backward(**_on_gpu(inputs), num_heads=2, precision=precision), ref)
    bad = {k: v for k, v in errors.items() if not v <= EDGE_TOLERANCE[precision]}
    assert not bad, bad


def test_head_dim_other_than_64_or_128_is_a_clear_error():
    inputs = cases.make_inputs(cases.Case(1, 8, 8, atol=0.0), hidden_size=256, seed=1)
    with pytest.raises(ValueError, match="supports head_dim 64 or 128; got .* head_dim 32"):
        cross_attention_backward(**_on_gpu(inputs), num_heads=8)


def _digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(_cupy().asnumpy(a).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_poisoned_out_is_fully_written_inputs_untouched_and_bitwise_repeatable(precision):
    cupy = _cupy()
    case = cases.Case(2, 691, 77, atol=0.16)
    inputs, ref = _case_data(case, 7)
    gpu_inputs = _on_gpu(inputs)
    before = _digest(gpu_inputs.values())
    first = cross_attention_backward(**gpu_inputs, precision=precision)
    # Separate buffers for every output, at addresses unrelated to the first call's.
    out = CrossAttentionGrads(*(cupy.full(g.shape, numpy.nan, numpy.float32) for g in first))
    second = cross_attention_backward(**gpu_inputs, precision=precision, out=out)
    assert all(s is o for s, o in zip(second, out))
    for name, a, b in zip(CrossAttentionGrads._fields, first, second):
        assert bool(cupy.isfinite(b).all()), name
        assert bool((a == b).all()), f"{name} differs between two calls"
    assert _digest(gpu_inputs.values()) == before
    assert all(row["passed"] for row in cases.compare(second, ref, atol=case.atol, rtol=case.rtol,
                                                        match_ratio=case.match_ratio))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_nan_and_inf_inputs_propagate_as_in_the_reference_and_the_next_call_is_clean(precision):
    # NaN and Inf are not rejected (docs/reliability.md): each output element is non-finite exactly
    # where the float64 reference's is (with NaN in X, grad_output_bias, dY's column sums, stays
    # finite; with +Inf in dY, dX's other rows do). Where the reference has ±Inf, the fp32 mode
    # may give NaN (its remainder products: reliability.md), so only finiteness is compared. The
    # fp16 scales come from the finite elements only, so the same plan's next call, on clean
    # inputs, passes the benchmark's rule: no scale, alpha or partial sum is left poisoned.
    cupy = _cupy()
    case = next(c for c in SUITE if c.label == "2x256x77")
    inputs, ref = _case_data(case, 9)
    for name, index, value in (("video_latents", (0, 0, 0), numpy.nan), ("key_weight", (0, 0), numpy.inf),
                               ("grad_output", (0, 0, 0), numpy.inf)):
        bad = {key: array.copy() for key, array in inputs.items()}
        bad[name][index] = value
        with numpy.errstate(invalid="ignore", over="ignore"):
            want = [numpy.isfinite(g) for g in reference.backward(**bad, num_heads=16)]
        assert any(w.any() and not w.all() for w in want), name  # some output mixes finite and not
        got = cross_attention_backward(**_on_gpu(bad), precision=precision)
        for output, w, g in zip(CrossAttentionGrads._fields, want, got):
            mismatched = int((cupy.asnumpy(cupy.isfinite(g)) != w).sum())
            assert mismatched == 0, f"{name}: {mismatched} elements of {output} differ in finiteness"
        clean = cross_attention_backward(**_on_gpu(inputs), precision=precision)
        rows = cases.compare(clean, ref, atol=case.atol, rtol=case.rtol, match_ratio=case.match_ratio)
        assert all(row["passed"] for row in rows), (name, rows)


def test_numpy_and_non_contiguous_inputs_give_the_same_results():
    cupy = _cupy()
    case = cases.Case(2, 200, 77, atol=0.0)
    inputs, _ = _case_data(case, 8)
    expected = cross_attention_backward(**_on_gpu(inputs))
    from_numpy = cross_attention_backward(**inputs)
    assert all(isinstance(g, numpy.ndarray) for g in from_numpy)
    # Every array a strided view of a larger one, same values.
    strided = {name: cupy.repeat(cupy.asarray(a)[..., None], 2, axis=-1)[..., 0] for name, a in inputs.items()}
    assert not strided["video_latents"].flags.c_contiguous
    from_strided = cross_attention_backward(**strided)
    for name, e, n, s in zip(CrossAttentionGrads._fields, expected, from_numpy, from_strided):
        assert numpy.array_equal(cupy.asnumpy(e), n), name
        assert bool((e == s).all()), name


def test_inputs_off_a_16_byte_boundary_are_read_correctly():
    # The kernels load inputs as float4: an array starting 4 bytes into a buffer is copied first.
    cupy = _cupy()
    case = cases.Case(1, 70, 20, atol=0.0)
    inputs, ref = _case_data(case, 12)
    shifted = {}
    for name, a in inputs.items():
        buffer = cupy.empty(a.size + 1, numpy.float32)
        shifted[name] = buffer[1:].reshape(a.shape)
        shifted[name][...] = cupy.asarray(a)
    assert shifted["query_bias"].data.ptr % 16
    errors = _relative_errors(cross_attention_backward(**shifted, precision="fp16"), ref)
    assert max(errors.values()) <= EDGE_TOLERANCE["fp16"], errors


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_half_modes_o_bound_follows_a_value_bias_that_dominates_and_grows(precision):
    # bv enters O's bound through its own fp16 scale (the first conversion group): a bias 2^6
    # times V0's entries dominates V, and the next call's, 2^12 times, moves that scale (a rescale
    # of bv before the attention reads it). O must neither overflow nor lose its precision: the
    # gradients through O and dV = Pᵀ·dO keep the edge tolerance, dWo 1e-3 (fp32: 5e-6; 1.1e-6 measured).
    # The gradients through dS = P∘(dP − D) cannot: with V ≈ bv in every key, dP_j and D agree up to
    # V0's share, 1/factor of V, and the attention's fp16 operand V = V0 + bv (11 significant bits,
    # |bv|·2^-12) is off by factor·2^-12 of what dS is made of (measured 1.3e-2 at 2^6; any attention
    # on fp16 operands shares this). At 2^6 they are held to factor·2^-11, at 2^12 only to be finite.
    # The fp32 mode's V carries 2^-24 of |bv| (fp32's own rounding of V0 + bv): factor·2^-20 (measured
    # 3.7e-5 at 2^6, 2.1e-3 at 2^12: about half that).
    case = cases.Case(2, 130, 77, atol=0.0)
    inputs, _ = _case_data(case, 6)
    through_o_or_dv = ("grad_output_weight", "grad_output_bias", "grad_value_weight", "grad_value_bias")
    for factor in (2.0 ** 6, 2.0 ** 12):
        call = dict(inputs, value_bias=inputs["value_bias"] * numpy.float32(factor))
        ref = reference.backward(**call, num_heads=16)
        errors = _relative_errors(cross_attention_backward(**_on_gpu(call), precision=precision), ref)
        if precision == "fp16":
            through_ds = factor * 2.0 ** -11 if factor < 2.0 ** 10 else 1e30  # finite: Inf and NaN fail
        else:
            through_ds = factor * 2.0 ** -20
        bad = {k: v for k, v in errors.items()
               if not v <= (EDGE_TOLERANCE[precision] if k in through_o_or_dv else through_ds)}
        assert not bad, (factor, bad)
        assert errors["grad_output_weight"] <= {"fp16": 1e-3, "fp32": 5e-6}[precision], (factor, errors)
