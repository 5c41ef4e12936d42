"""The CuPy forward against the float64 reference, and the training example on a GPU (marker ``gpu``)."""
import sys
from pathlib import Path

import numpy
import pytest

from cupy_xattn import cases, cross_attention_forward, reference

pytestmark = pytest.mark.gpu

TOLERANCE = {"tf32": 5e-3, "fp32": 1e-5}  # max|y − ref| / max|ref|


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("shape, hidden, heads, lengths", [
    ((2, 130, 77), 1024, 16, None), ((2, 130, 77), 1024, 16, (40, 77)), ((1, 1, 5), 1024, 16, None),
    ((3, 70, 211), 512, 8, (211, 1, 100)), ((2, 100, 50), 256, 2, (50, 17))],
    ids=["2x130x77", "padded", "one-row", "long-text-padded", "head-dim-128"])
def test_forward_matches_the_reference(shape, hidden, heads, lengths, precision):
    import cupy
    inputs = cases.make_inputs(cases.Case(*shape, atol=0.0), hidden_size=hidden, seed=2)
    args = {name: a for name, a in inputs.items() if name != "grad_output"}
    want = reference.forward(*args.values(), num_heads=heads,
                             text_lengths=None if lengths is None else numpy.array(lengths))
    got = cross_attention_forward(**{k: cupy.asarray(a) for k, a in args.items()}, num_heads=heads,
                                  precision=precision, text_lengths=lengths)
    assert isinstance(got, cupy.ndarray) and got.shape == want.shape
    error = float(numpy.abs(cupy.asnumpy(got) - want).max() / numpy.abs(want).max())
    assert error <= TOLERANCE[precision], error


def test_forward_keeps_a_sample_whose_text_is_far_below_the_others():
    # Sample 1's text 2^-12 and video 2^12 times sample 0's: its keys K0 are ~2^-12 of |bk| and its
    # queries ~2^12 large. bk, rounded with K0 to the fp32 mode's 3xTF32 operands, would leave its
    # rounding times |Q| in the scores (attention_fwd.cu leaves bk out): ~6e-4 in sample 1's output
    # by a NumPy model of that arithmetic, against ~6e-7 without. bv and bo are zero here, so that
    # the output is all attention (with them, P·V0·Wo^T would be ~2^-12 of it).
    import cupy
    inputs = cases.make_inputs(cases.Case(2, 130, 77, atol=0.0), seed=3)
    args = {name: a.copy() for name, a in inputs.items() if name != "grad_output"}
    args["text_embeddings"][1] *= numpy.float32(2.0 ** -12)
    args["video_latents"][1] *= numpy.float32(2.0 ** 12)
    args["value_bias"][:] = 0
    args["output_bias"][:] = 0
    want = reference.forward(*args.values(), num_heads=16)[1]
    got = cupy.asnumpy(cross_attention_forward(**{k: cupy.asarray(a) for k, a in args.items()}, num_heads=16,
                                               precision="fp32"))[1]
    error = float(numpy.abs(got - want).max() / numpy.abs(want).max())
    assert error <= TOLERANCE["fp32"], error


def test_forward_of_numpy_inputs_returns_numpy():
    inputs = cases.make_inputs(cases.Case(1, 20, 9, atol=0.0), hidden_size=128, seed=4)
    args = {name: a for name, a in inputs.items() if name != "grad_output"}
    got = cross_attention_forward(**args, num_heads=2)
    assert isinstance(got, numpy.ndarray)
    want = reference.forward(*args.values(), num_heads=2)
    assert numpy.abs(got - want).max() / numpy.abs(want).max() <= TOLERANCE["tf32"]


def test_the_training_example_makes_the_loss_fall_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        from train_tiny import train
    finally:
        sys.path.pop(0)
    losses = train("cupy", steps=15, hidden=128, heads=2, log=lambda line: None)
    assert losses[-1] < 0.5 * losses[0], losses
