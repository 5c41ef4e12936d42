"""Property-based checks (hypothesis): random valid and invalid shapes through validation and the reference."""
import numpy
import pytest
from hypothesis import given, settings, strategies as st

from cupy_xattn import cross_attention_backward, reference
from cupy_xattn.cases import Case, make_inputs
from cupy_xattn.checks import INPUT_SHAPES, validate
from cupy_xattn.grads import INPUT_NAMES

sizes = st.fixed_dictionaries({
    "batch": st.integers(1, 3), "video": st.integers(1, 6), "text": st.integers(1, 6),
    "heads": st.integers(1, 3), "head_dim": st.integers(1, 4), "seed": st.integers(0, 2**16)})


def _inputs(s):
    case = Case(s["batch"], s["video"], s["text"], atol=0.0)
    return make_inputs(case, hidden_size=s["heads"] * s["head_dim"], seed=s["seed"])


@settings(max_examples=40, deadline=None)
@given(sizes)
def test_any_valid_shape_validates_and_the_reference_keeps_its_identities(s):
    inputs = _inputs(s)
    problem = validate(inputs, scale=None, num_heads=s["heads"], precision="tf32", backend="numpy", out=None)
    assert (problem.batch_size, problem.num_video_tokens, problem.num_text_tokens, problem.head_dim) == (
        s["batch"], s["video"], s["text"], s["head_dim"])
    assert problem.scale == pytest.approx(s["head_dim"] ** -0.5)
    grads = cross_attention_backward(**inputs, num_heads=s["heads"], backend="numpy")
    for name, grad in zip(INPUT_NAMES[1:], grads):
        assert grad.shape == inputs[name].shape and grad.dtype == numpy.float32
        assert numpy.isfinite(grad).all(), name
    # Each softmax row's gradient sums to zero, so grad_key_bias vanishes (float64 rounding only).
    exact = reference.backward(**inputs, num_heads=s["heads"])
    scale = 1.0 + numpy.abs(exact.grad_value_bias).max()
    assert numpy.abs(exact.grad_key_bias).max() <= 1e-12 * scale


@settings(max_examples=60, deadline=None)
@given(sizes, st.sampled_from(INPUT_NAMES), st.data())
def test_any_wrong_dimension_is_a_value_error_naming_the_argument(s, name, data):
    inputs = _inputs(s)
    shape = list(inputs[name].shape)
    axis = data.draw(st.integers(0, len(shape) - 1))
    shape[axis] += data.draw(st.integers(1, 3))
    inputs[name] = numpy.zeros(shape, numpy.float32)
    symbol = INPUT_SHAPES[name][axis]
    sharing = [other for other in INPUT_NAMES if other != name and symbol in INPUT_SHAPES[other]]
    if not sharing:  # Nt lives in text_embeddings alone: another valid problem
        problem = validate(inputs, scale=None, num_heads=s["heads"], precision="tf32", backend="numpy", out=None)
        assert problem.num_text_tokens == shape[axis]
        return
    with pytest.raises(ValueError) as error:
        validate(inputs, scale=None, num_heads=s["heads"], precision="tf32", backend="numpy", out=None)
    # The sizes are read from video_latents and text_embeddings first: a wrong size there
    # makes the arguments that agree with the true size the ones named.
    named = str(error.value)
    assert name in named or any(other in named for other in sharing)


@settings(max_examples=30, deadline=None)
@given(sizes, st.sampled_from(INPUT_NAMES), st.sampled_from([numpy.float64, numpy.int32, numpy.complex64]))
def test_any_wrong_dtype_is_a_type_error_naming_the_argument(s, name, dtype):
    inputs = _inputs(s)
    inputs[name] = inputs[name].astype(dtype)
    with pytest.raises(TypeError, match=name):
        validate(inputs, scale=None, num_heads=s["heads"], precision="tf32", backend="numpy", out=None)


@settings(max_examples=40, deadline=None)
@given(sizes, st.data())
def test_any_text_lengths_validate_or_are_refused_and_padding_only_zeroes_the_padded_tokens(s, data):
    inputs = _inputs(s)
    lengths = data.draw(st.lists(st.integers(-1, s["text"] + 1), min_size=s["batch"], max_size=s["batch"]))
    valid = all(1 <= n <= s["text"] for n in lengths)
    if not valid:
        with pytest.raises(ValueError, match=r"text_lengths must lie in \[1, Nt\]"):
            cross_attention_backward(**inputs, num_heads=s["heads"], backend="numpy", text_lengths=lengths)
        return
    grads = cross_attention_backward(**inputs, num_heads=s["heads"], backend="numpy", text_lengths=lengths)
    for b, n in enumerate(lengths):
        assert not grads.grad_text_embeddings[b, n:].any()
        assert numpy.isfinite(grads.grad_text_embeddings[b, :n]).all()
