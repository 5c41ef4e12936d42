"""The forward call and the CrossAttention layer object on the NumPy backend (no GPU needed)."""
import sys
from pathlib import Path

import numpy
import pytest

from cupy_xattn import CrossAttention, cross_attention_backward, cross_attention_forward, reference
from cupy_xattn.cases import Case, make_inputs

H = 2


@pytest.fixture
def inputs():
    return make_inputs(Case(2, 7, 5, atol=0.0), hidden_size=16, seed=3)


def _forward_inputs(inputs):
    return {name: a for name, a in inputs.items() if name != "grad_output"}


def test_numpy_forward_passes_scale_heads_and_lengths_to_the_reference_and_returns_float32(inputs):
    args = _forward_inputs(inputs)
    y = cross_attention_forward(**args, scale=0.4, num_heads=H, backend="numpy", text_lengths=[2, 5])
    want = reference.forward(*args.values(), 0.4, num_heads=H, text_lengths=numpy.array([2, 5]))
    assert isinstance(y, numpy.ndarray) and y.dtype == numpy.float32
    numpy.testing.assert_array_equal(y, want.astype(numpy.float32))


def test_forward_text_lengths_cut_each_sample_s_text(inputs):
    args = _forward_inputs(inputs)
    lengths = [3, args["text_embeddings"].shape[1] - 1]  # both samples cut
    padded = cross_attention_forward(**args, num_heads=H, backend="numpy", text_lengths=lengths)
    for b, n in enumerate(lengths):
        alone = dict(args, video_latents=args["video_latents"][b:b + 1], text_embeddings=args["text_embeddings"][b:b + 1, :n])
        numpy.testing.assert_allclose(padded[b:b + 1], cross_attention_forward(**alone, num_heads=H, backend="numpy"),
                                      rtol=1e-6, atol=1e-6)


def test_forward_argument_errors_name_the_forward(inputs):
    args = _forward_inputs(inputs)
    with pytest.raises(ValueError, match="(?s)cross_attention_forward: invalid arguments:.*query_weight has shape"):
        cross_attention_forward(**dict(args, query_weight=args["query_weight"][:, :3]), num_heads=H, backend="numpy")
    with pytest.raises(TypeError, match="(?s)cross_attention_forward: invalid argument types:.*float64"):
        cross_attention_forward(**dict(args, key_bias=args["key_bias"].astype(numpy.float64)), num_heads=H,
                                backend="numpy")
    with pytest.raises(ValueError, match="(?s)cross_attention_forward: invalid arguments:.*text_lengths must lie"):
        cross_attention_forward(**args, num_heads=H, backend="numpy", text_lengths=[0, 5])
    with pytest.raises(ValueError, match="precision 'fp16' is not supported by the forward"):
        cross_attention_forward(**args, num_heads=H, precision="fp16")


def test_layer_backward_returns_input_gradients_and_accumulates_parameter_gradients(inputs):
    layer = CrossAttention(16, H, backend="numpy", seed=5)
    x, t, dy = inputs["video_latents"], inputs["text_embeddings"], inputs["grad_output"]
    y = layer.forward(x, t, text_lengths=[4, 5])
    numpy.testing.assert_array_equal(y, cross_attention_forward(x, t, *layer.params.values(), num_heads=H,
                                                                backend="numpy", text_lengths=[4, 5]))
    want = cross_attention_backward(dy, x, t, *layer.params.values(), num_heads=H, backend="numpy",
                                    text_lengths=[4, 5])
    dx, dt = layer.backward(dy)
    numpy.testing.assert_array_equal(dx, want.grad_video_latents)
    numpy.testing.assert_array_equal(dt, want.grad_text_embeddings)
    layer.backward(dy)  # a second backward adds the same gradients again
    for name, grad in layer.grads.items():
        numpy.testing.assert_allclose(grad, 2 * getattr(want, "grad_" + name), rtol=1e-6, atol=1e-7, err_msg=name)
    layer.zero_grad()
    assert not any(g.any() for g in layer.grads.values())


def test_layer_backward_needs_a_forward():
    with pytest.raises(RuntimeError, match="needs a forward first"):
        CrossAttention(16, H, backend="numpy").backward(numpy.zeros((1, 2, 16), numpy.float32))


def test_the_training_example_makes_the_loss_fall():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        from train_tiny import train
    finally:
        sys.path.pop(0)
    losses = train("numpy", steps=15, log=lambda line: None)
    assert losses[-1] < 0.4 * losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses


def test_layer_refuses_a_precision_the_forward_lacks():
    with pytest.raises(ValueError, match="CrossAttention: precision must be one of 'fp32', 'tf32'"):
        CrossAttention(16, H, precision="fp16", backend="numpy")


def test_forward_of_float16_activations_is_float16(inputs):
    args = _forward_inputs(inputs)
    half = dict(args, video_latents=args["video_latents"].astype(numpy.float16),
                text_embeddings=args["text_embeddings"].astype(numpy.float16))
    y = cross_attention_forward(**half, num_heads=H, backend="numpy")
    want = cross_attention_forward(**{k: a.astype(numpy.float32) for k, a in half.items()}, num_heads=H,
                                   backend="numpy")
    assert y.dtype == numpy.float16
    numpy.testing.assert_array_equal(y, want.astype(numpy.float16))
