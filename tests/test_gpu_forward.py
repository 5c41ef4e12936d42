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
