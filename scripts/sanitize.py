"""Drive the library's GPU work for compute-sanitizer, shape by shape.

Usage (on a GPU machine, from the checkout):
    PYTHONPATH=. compute-sanitizer --tool memcheck python3 scripts/sanitize.py 2x64x77 2x130x93
    PYTHONPATH=. compute-sanitizer --tool racecheck python3 scripts/sanitize.py --precision fp16 2x64x77:256:2

A shape is BxNvxNt, or BxNvxNt:D:H for another hidden size and head count (2x64x77:256:2 has
head_dim 128). Per shape: the backward twice (a first, direct run, then a graph replay), the
backward with padded text lengths (see padded_lengths), and, in fp32 and tf32, the forward with
and without them. Every result is checked to be finite: the run fails otherwise.
"""
import argparse

import cupy
import numpy

import cupy_xattn
from cupy_xattn import cases, forward


def parse(shape):
    """(Case, hidden size, heads) of 'BxNvxNt' or 'BxNvxNt:D:H'."""
    label, *sizes = shape.split(":")
    hidden_size, num_heads = map(int, sizes) if sizes else (1024, 16)
    return cases.parse_shape(label, atol=0.0), hidden_size, num_heads


def padded_lengths(batch_size, num_text_tokens):
    """Two sets of text lengths: sample 0 at 1 token and sample 1 at Nt − 33 (so that the streamed
    kernel skips whole key tiles past them), then random lengths in [1, Nt]."""
    first = numpy.resize(numpy.array([1, max(1, num_text_tokens - 33)], numpy.int32), batch_size)
    random = numpy.random.default_rng(1).integers(1, num_text_tokens + 1, batch_size, dtype=numpy.int32)
    return first, random


def run(shape, precision):
    case, hidden_size, num_heads = parse(shape)
    inputs = cases.make_inputs(case, hidden_size=hidden_size, seed=1, xp=cupy)
    padded = padded_lengths(case.batch_size, case.num_text_tokens)
    options = dict(num_heads=num_heads, precision=precision)
    results = []
    for text_lengths in (None, None, *padded):  # direct, replayed, padded
        results += cupy_xattn.cross_attention_backward(**inputs, **options, text_lengths=text_lengths)
    if precision in forward.PRECISIONS:
        del inputs["grad_output"]
        for text_lengths in (None, *padded):
            results.append(cupy_xattn.cross_attention_forward(**inputs, **options, text_lengths=text_lengths))
    cupy.cuda.Device().synchronize()
    return all(bool(cupy.isfinite(r).all()) for r in results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="BxNvxNt or BxNvxNt:D:H")
    parser.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "fp16"])
    args = parser.parse_args()
    for shape in args.shapes:
        finite = run(shape, args.precision)
        print(f"{shape} {args.precision}: {'finite' if finite else 'NOT FINITE'}", flush=True)
        if not finite:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
