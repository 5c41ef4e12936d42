"""Property-based checks (hypothesis): random valid and invalid shapes through validation and the reference."""
import numpy
import pytest
from hypothesis import given, settings, strategies as st

from cupy_xattn import cross_attention_backward, reference
from cupy_xattn.cases import Case, make_inputs
from cupy_xattn.checks import _SIZE_SOURCES, INPUT_SHAPES, validate
from cupy_xattn.grads import INPUT_NAMES
from identities import assert_gradient_identities

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
    exact = reference.backward(**inputs, num_heads=s["heads"])
    assert_gradient_identities(inputs, exact, num_heads=s["heads"], rtol=1e-12)
    for got, want in zip(grads, exact):  # the numpy backend: the reference, rounded to float32
        numpy.testing.assert_array_equal(got, want.astype(numpy.float32))


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
    # Each size is read from the first argument that has it (video_latents: B, Nv, D; then
    # text_embeddings: Nt): a wrong size there makes every other argument with it the ones named.
    source = next(n for n in _SIZE_SOURCES if symbol in INPUT_SHAPES[n])
    named = {n for n in INPUT_NAMES if f"\n    {n} has shape" in str(error.value)}
    assert named == (set(sharing) if name == source else {name}), str(error.value)


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
    # Sample b's gradients are those of the sample alone with its text cut to n tokens (the weights'
    # and biases' are sums over the samples), and its padded tokens' are zero.
    cuts = []
    for b, n in enumerate(lengths):
        alone = {name: a[b:b + 1] if a.ndim == 3 else a for name, a in inputs.items()}
        alone["text_embeddings"] = alone["text_embeddings"][:, :n]
        cuts.append(reference.backward(**alone, num_heads=s["heads"]))
        assert not grads.grad_text_embeddings[b, n:].any()
        numpy.testing.assert_allclose(grads.grad_video_latents[b], cuts[-1].grad_video_latents[0], rtol=1e-5, atol=1e-6)
        numpy.testing.assert_allclose(grads.grad_text_embeddings[b, :n], cuts[-1].grad_text_embeddings[0],
                                      rtol=1e-5, atol=1e-6)
    exact = reference.backward(**inputs, num_heads=s["heads"], text_lengths=lengths)
    for name in INPUT_NAMES[3:]:  # the weights and biases
        numpy.testing.assert_allclose(getattr(exact, "grad_" + name), sum(getattr(cut, "grad_" + name) for cut in cuts),
                                      rtol=1e-9, atol=1e-12, err_msg=name)
