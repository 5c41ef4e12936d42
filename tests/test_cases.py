"""Suites, shapes, inputs, FLOP counts and the benchmark's pass rule."""
import numpy
import pytest

from cupy_xattn.cases import Case, compare, flops, load_suite, make_inputs, parse_shape, suite_sizes
from cupy_xattn.checks import INPUT_SHAPES
from cupy_xattn.grads import CrossAttentionGrads


def test_suite_has_the_16_benchmark_cases():
    suite = load_suite("sol-execbench")
    assert len(suite) == 16
    assert suite[0] == Case(64, 128, 77, 0.4, 1e-5, 0.99)
    assert all(0.099 <= c.atol <= 0.52 and c.rtol == 1e-5 and c.match_ratio == 0.99 for c in suite)


def test_wan_suite_and_the_layer_sizes_of_each_suite():
    assert [c.label for c in load_suite("wan22-a14b")] == ["1x1560x512", "1x4096x512", "1x32760x512"]
    assert suite_sizes("wan22-a14b") == (5120, 40) and suite_sizes("sol-execbench") == (1024, 16)
    with pytest.raises(ValueError, match="unknown suite"):
        suite_sizes("nope")


def test_unknown_suite():
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        load_suite("nope")


def test_suite_work_is_731_gflop():
    work = [flops(c.batch_size, c.num_video_tokens, c.num_text_tokens, 1024) for c in load_suite("sol-execbench")]
    assert sum(work) / 1e9 == pytest.approx(731, abs=0.5)
    assert max(work) == flops(64, 128, 77, 1024) and max(work) / 1e9 == pytest.approx(156, abs=0.5)


def test_flops_by_term():
    # Mv = 6, Mt = 4, Nt = 2, D = 3
    assert flops(2, 3, 2, 3) == 10 * 6 * 9 + 12 * 4 * 9 + 12 * 6 * 2 * 3


@pytest.mark.parametrize("text, sizes", [("2x64x77", (2, 64, 77)), (" 1X1x1 ", (1, 1, 1))])
def test_parse_shape(text, sizes):
    assert parse_shape(text, atol=0.2) == Case(*sizes, atol=0.2, rtol=1e-5, match_ratio=0.99)
    assert parse_shape(text, atol=0.2).label == "x".join(map(str, sizes))


@pytest.mark.parametrize("text", ["2x64", "axbxc", "2x0x7", "2x-1x7", "2x64x7x1", "", "2*64*7"])
def test_parse_shape_rejects(text):
    with pytest.raises(ValueError, match="BxNvxNt"):
        parse_shape(text, atol=0.1)


def test_make_inputs_has_the_benchmark_distribution():
    inputs = make_inputs(Case(4, 64, 33, atol=0.1), hidden_size=256, seed=5)
    assert list(inputs) == list(INPUT_SHAPES)
    dims = {"B": 4, "Nv": 64, "Nt": 33, "D": 256}
    for name, a in inputs.items():
        assert a.dtype == numpy.float32 and a.shape == tuple(dims[s] for s in INPUT_SHAPES[name]), name
    assert inputs["query_weight"].std() == pytest.approx(1 / 16, rel=0.02)
    assert inputs["video_latents"].std() == pytest.approx(1, rel=0.02)
    again = make_inputs(Case(4, 64, 33, atol=0.1), hidden_size=256, seed=5)
    assert all(numpy.array_equal(inputs[n], again[n]) for n in inputs)
    other = make_inputs(Case(4, 64, 33, atol=0.1), hidden_size=256, seed=6)
    assert not numpy.array_equal(inputs["grad_output"], other["grad_output"])


def _reference():
    rng = numpy.random.default_rng(0)
    return CrossAttentionGrads(*(rng.standard_normal(100) for _ in CrossAttentionGrads._fields))


def test_compare_passes_small_errors():
    ref = _reference()
    rows = compare([r + 0.05 for r in ref], ref, atol=0.1, rtol=1e-5, match_ratio=0.99)
    assert [r["name"] for r in rows] == list(CrossAttentionGrads._fields)
    assert all(r["passed"] and r["match_ratio"] == 1.0 and r["max_abs_err"] == pytest.approx(0.05) for r in rows)


def test_compare_rule():
    ref = _reference()
    got = [r.copy() for r in ref]
    got[0][:2] += 1.0  # 98% match: fails
    got[1][:1] += 1.0  # 99% match: passes
    got[2][5] = numpy.nan
    got[3][7] = numpy.inf
    got[4][:] = 0.0  # all zero where the reference is not
    ref[5][:] = 0.0
    got[5][:] = 0.0  # all zero where the reference is too: fine
    got[6][:] = ref[6] + 0.0999 + 0.9e-5 * abs(ref[6])  # just inside atol + rtol |ref|
    got[7][:] = ref[7] + 0.1001 + 1.1e-5 * abs(ref[7])  # just outside
    rows = compare(got, ref, atol=0.1, rtol=1e-5, match_ratio=0.99)
    assert [r["passed"] for r in rows] == [False, True, False, False, False, True, True, False, True, True]
    assert rows[0]["match_ratio"] == pytest.approx(0.98) and rows[1]["max_abs_err"] == pytest.approx(1.0)


def test_compare_zero_output_of_tiny_reference_fails():
    ref = _reference()
    got = list(ref)
    got[5] = numpy.zeros(100)
    ref = ref._replace(grad_key_bias=numpy.full(100, 1e-9))  # within atol everywhere, yet zeros are a shortcut
    assert not compare(got, ref, atol=0.1, rtol=1e-5, match_ratio=0.99)[5]["passed"]
