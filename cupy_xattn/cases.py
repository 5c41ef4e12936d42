"""Benchmark cases: the SOL-ExecBench suite, ad-hoc shapes, their inputs, FLOP counts and the pass rule."""
import json
import re
from pathlib import Path
from typing import NamedTuple

import numpy

from ._cupy import to_numpy
from .checks import INPUT_SHAPES
from .grads import CrossAttentionGrads

SUITES = {"sol-execbench": "sol_execbench_cases.json", "wan22-a14b": "wan22_a14b_cases.json"}
_DATA = Path(__file__).parent / "data"
_SHAPE = re.compile(r"\s*(\d+)x(\d+)x(\d+)\s*", re.IGNORECASE)


class Case(NamedTuple):
    """One problem size and its tolerance: an element passes when |x - y| <= atol + rtol |y|."""

    batch_size: int
    num_video_tokens: int
    num_text_tokens: int
    atol: float
    rtol: float = 1e-5
    match_ratio: float = 0.99

    @property
    def label(self):
        """'BxNvxNt', the form ``parse_shape`` reads."""
        return f"{self.batch_size}x{self.num_video_tokens}x{self.num_text_tokens}"


def load_suite(name):
    """The cases of a named suite (``SUITES``), in the suite's order.

    Raises
    ------
    ValueError
        Unknown suite.
    """
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    spec = json.loads((_DATA / SUITES[name]).read_text())
    return [Case(c["batch_size"], c["num_video_tokens"], c["num_text_tokens"], c["atol"], c["rtol"],
                 c["match_ratio"]) for c in spec["cases"]]


def suite_sizes(name):
    """(hidden_size, num_heads) of a named suite's layer."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    constants = json.loads((_DATA / SUITES[name]).read_text())["constants"]
    return constants["hidden_size"], constants["num_heads"]


def parse_shape(text, *, atol, rtol=1e-5, match_ratio=0.99):
    """Case from 'BxNvxNt' (e.g. '2x64x77'), all three positive.

    Raises
    ------
    ValueError
        Any other text.
    """
    match = _SHAPE.fullmatch(text)
    if not match or 0 in (sizes := tuple(int(g) for g in match.groups())):
        raise ValueError(f"expected BxNvxNt with three positive integers, e.g. 2x64x77; got {text!r}")
    return Case(*sizes, atol=atol, rtol=rtol, match_ratio=match_ratio)


def make_inputs(case, *, hidden_size=1024, seed, xp=numpy):
    """The 11 float32 inputs of ``case`` with the benchmark's distribution.

    Weights are randn / sqrt(hidden_size), everything else randn. Drawn on the host with
    NumPy, so every ``xp`` (numpy or cupy) gets the same values for the same seed.

    Returns
    -------
    dict
        Name -> ``xp`` array, in the public argument order.
    """
    dims = {"B": case.batch_size, "Nv": case.num_video_tokens, "Nt": case.num_text_tokens, "D": hidden_size}
    rng = numpy.random.default_rng(seed)
    inputs = {}
    for name, symbols in INPUT_SHAPES.items():
        array = rng.standard_normal(tuple(dims[s] for s in symbols), dtype=numpy.float32)
        if name.endswith("_weight"):
            array /= numpy.float32(numpy.sqrt(hidden_size))
        inputs[name] = xp.asarray(array)
    return inputs


def flops(batch_size, num_video_tokens, num_text_tokens, hidden_size):
    """GEMM work of one backward call, as counted in WORKLOAD.md.

    10 Mv D^2 (Q recompute, dO, dWo, dX, dWq) + 12 Mt D^2 (K and V recompute, dT, dWk, dWv)
    + 12 Mv Nt D (S recompute, O, dP, dV, dQ, dK), with Mv = B Nv and Mt = B Nt.
    """
    video_rows, text_rows = batch_size * num_video_tokens, batch_size * num_text_tokens
    return (10 * video_rows * hidden_size**2 + 12 * text_rows * hidden_size**2
            + 12 * video_rows * num_text_tokens * hidden_size)


def compare(got, ref, *, atol, rtol, match_ratio):
    """Apply the benchmark's rule to each of the 10 outputs.

    An element matches when |x - y| <= atol + rtol |y|; an output passes when at least
    ``match_ratio`` of its elements match, none is NaN/Inf, and it is not all zeros where
    the reference is not.

    Parameters
    ----------
    got : CrossAttentionGrads (or 10-sequence) of NumPy or CuPy arrays
    ref : CrossAttentionGrads of NumPy arrays (float64 reference)
    atol, rtol : float
        The element rule's tolerances.
    match_ratio : float
        The fraction of elements that must match.

    Returns
    -------
    list of dict
        One per output: name, max_abs_err, atol, match_ratio (the observed ratio), passed.
    """
    rows = []
    for name, x, y in zip(CrossAttentionGrads._fields, got, ref):
        x, y = to_numpy(x).astype(numpy.float64), numpy.asarray(y, dtype=numpy.float64)
        error = numpy.abs(x - y)
        ratio = float(numpy.mean(error <= atol + rtol * numpy.abs(y)))
        zeroed = not x.any() and y.any()
        passed = bool(numpy.isfinite(x).all() and ratio >= match_ratio and not zeroed)
        rows.append({"name": name, "max_abs_err": float(error.max()), "atol": atol,
                     "match_ratio": ratio, "passed": passed})
    return rows
