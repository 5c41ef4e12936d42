"""The float64 reference, checked against the math before anything is checked against it."""
import numpy
import pytest

from cupy_xattn import reference
from cupy_xattn.cases import Case, make_inputs
from cupy_xattn.grads import INPUT_NAMES, CrossAttentionGrads
from identities import assert_gradient_identities

# (B, Nv, Nt, D, H): tiny, with sizes that share no factor, and one with a single head.
SHAPES = [(2, 3, 4, 8, 2), (1, 5, 2, 6, 1), (3, 2, 3, 12, 3)]


def _inputs(batch_size, video_tokens, text_tokens, hidden_size, seed=0):
    arrays = make_inputs(Case(batch_size, video_tokens, text_tokens, atol=0.0), hidden_size=hidden_size, seed=seed)
    return {name: a.astype(numpy.float64) for name, a in arrays.items()}


def _forward_by_loops(X, T, Wq, bq, Wk, bk, Wv, bv, Wo, bo, scale, num_heads):
    """WORKLOAD.md's forward, one (batch, head) at a time."""
    head_dim = X.shape[-1] // num_heads
    Y = numpy.empty_like(X)
    for b in range(X.shape[0]):
        Q, K, V = X[b] @ Wq.T + bq, T[b] @ Wk.T + bk, T[b] @ Wv.T + bv
        O = numpy.empty_like(Q)
        for h in range(num_heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            S = scale * Q[:, cols] @ K[:, cols].T
            P = numpy.exp(S) / numpy.exp(S).sum(axis=1, keepdims=True)
            O[:, cols] = P @ V[:, cols]
        Y[b] = O @ Wo.T + bo
    return Y


@pytest.mark.parametrize("shape", SHAPES + [(1, 3, 2, 256, 2)])  # the last: head_dim 128, as Wan2.2 A14B
def test_forward_matches_the_math(shape):
    *sizes, num_heads = shape
    inputs = _inputs(*sizes)
    args = [inputs[name] for name in INPUT_NAMES[1:]]
    scale = 0.7
    numpy.testing.assert_allclose(reference.forward(*args, scale, num_heads=num_heads),
                                  _forward_by_loops(*args, scale, num_heads), rtol=1e-12, atol=1e-12)


def test_default_scale_is_one_over_sqrt_head_dim():
    inputs = _inputs(2, 3, 4, 8)
    args = [inputs[name] for name in INPUT_NAMES[1:]]
    numpy.testing.assert_allclose(reference.forward(*args, num_heads=2),
                                  reference.forward(*args, 0.5, num_heads=2), rtol=1e-15)


def _check_against_central_differences(grads, params, loss, step=1e-6):
    """Each gradient against (loss(p + step) − loss(p − step)) / 2·step, element by element
    (``loss`` reads ``params``, which are perturbed in place and restored)."""
    for name, param, grad in zip(CrossAttentionGrads._fields, params, grads):
        assert grad.shape == param.shape and grad.dtype == numpy.float64, name
        numeric = numpy.empty_like(param)
        for index in numpy.ndindex(param.shape):
            saved = param[index]
            param[index] = saved + step
            plus = loss()
            param[index] = saved - step
            minus = loss()
            param[index] = saved
            numeric[index] = (plus - minus) / (2 * step)
        numpy.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_gradient_matches_central_differences(shape):
    """loss = sum(Y * G) with a random G, so dloss/dY = G is the grad_output."""
    *sizes, num_heads = shape
    inputs = _inputs(*sizes, seed=1)
    G = inputs["grad_output"]
    params = [inputs[name] for name in INPUT_NAMES[1:]]
    scale = 0.6

    def loss():
        return numpy.sum(reference.forward(*params, scale, num_heads=num_heads) * G)

    _check_against_central_differences(reference.backward(G, *params, scale, num_heads=num_heads), params, loss)


@pytest.mark.parametrize("shape", SHAPES)
def test_gradient_identities(shape):
    *sizes, num_heads = shape
    inputs = _inputs(*sizes, seed=2)
    grads = reference.backward(*inputs.values(), num_heads=num_heads)
    # Identities that do not reuse the reference's formulas (tests/identities.py), with and without
    # padded texts.
    assert_gradient_identities(inputs, grads, num_heads=num_heads, rtol=1e-12)
    nt = sizes[2]
    lengths = [max(min(2, nt - 1), nt - 1 - b) for b in range(sizes[0])]  # at least 2 keys where Nt > 2
    padded = reference.backward(*inputs.values(), num_heads=num_heads, text_lengths=lengths)
    assert_gradient_identities(inputs, padded, num_heads=num_heads, text_lengths=lengths, rtol=1e-12)


def test_inputs_are_not_modified_and_float32_is_accepted():
    inputs = make_inputs(Case(2, 3, 4, atol=0.0), hidden_size=8, seed=3)
    before = {name: a.copy() for name, a in inputs.items()}
    grads = reference.backward(*inputs.values(), num_heads=2)
    assert all(g.dtype == numpy.float64 for g in grads)
    for name, a in inputs.items():
        numpy.testing.assert_array_equal(a, before[name], err_msg=name)


def test_text_padding_gradients_match_central_differences():
    inputs = _inputs(2, 3, 4, 8, seed=4)
    G = inputs["grad_output"]
    params = [inputs[name] for name in INPUT_NAMES[1:]]
    lengths = numpy.array([2, 4])

    def loss():
        return numpy.sum(reference.forward(*params, 0.6, num_heads=2, text_lengths=lengths) * G)

    _check_against_central_differences(reference.backward(G, *params, 0.6, num_heads=2, text_lengths=lengths),
                                       params, loss)


PARAMETER_GRADS = ("grad_query_weight", "grad_key_weight", "grad_value_weight", "grad_output_weight",
                   "grad_query_bias", "grad_value_bias", "grad_output_bias")


def test_text_padding_equals_the_truncated_texts():
    # Sample b with length L gives what its first L text tokens alone give; the padded tokens'
    # gradients are exactly zero, and the weight gradients sum the samples' own.
    inputs = _inputs(3, 4, 5, 12, seed=5)
    lengths = numpy.array([5, 1, 3])
    grads = reference.backward(*inputs.values(), num_heads=3, text_lengths=lengths)
    Y = reference.forward(*list(inputs.values())[1:], num_heads=3, text_lengths=lengths)
    summed = None
    for b, length in enumerate(lengths):
        alone = dict(inputs, grad_output=inputs["grad_output"][b:b + 1], video_latents=inputs["video_latents"][b:b + 1],
                     text_embeddings=inputs["text_embeddings"][b:b + 1, :length])
        g = reference.backward(*alone.values(), num_heads=3)
        numpy.testing.assert_allclose(Y[b:b + 1], reference.forward(*list(alone.values())[1:], num_heads=3),
                                      rtol=1e-12, atol=1e-12)
        numpy.testing.assert_allclose(grads.grad_video_latents[b], g.grad_video_latents[0], rtol=1e-12, atol=1e-12)
        numpy.testing.assert_allclose(grads.grad_text_embeddings[b, :length], g.grad_text_embeddings[0],
                                      rtol=1e-12, atol=1e-12)
        assert not grads.grad_text_embeddings[b, length:].any()
        parameters = {name: getattr(g, name) for name in PARAMETER_GRADS}
        summed = parameters if summed is None else {name: summed[name] + parameters[name] for name in PARAMETER_GRADS}
    for name in PARAMETER_GRADS:
        numpy.testing.assert_allclose(getattr(grads, name), summed[name], rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("lengths, message", [([0, 2], r"\[1, 4\]"), ([5, 2], r"\[1, 4\]"),
                                              ([2], "2 integers"), ([1.5, 2.0], "2 integers")])
def test_text_lengths_out_of_range_are_refused(lengths, message):
    inputs = _inputs(2, 3, 4, 8)
    with pytest.raises(ValueError, match=message):
        reference.backward(*inputs.values(), num_heads=2, text_lengths=numpy.array(lengths))
