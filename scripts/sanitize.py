"""Drive the backward for compute-sanitizer: a first (direct) run and a graph replay per shape.

Usage (on a GPU machine, from the checkout):
    PYTHONPATH=. compute-sanitizer --tool memcheck python3 scripts/sanitize.py 2x64x77 2x130x93
    PYTHONPATH=. compute-sanitizer --tool racecheck python3 scripts/sanitize.py --precision fp16 2x64x77
Each shape runs twice (direct, then replayed); the outputs are checked to be finite.
"""
import argparse

import cupy

import cupy_xattn
from cupy_xattn import cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="BxNvxNt")
    parser.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "fp16"])
    args = parser.parse_args()
    for shape in args.shapes:
        case = cases.parse_shape(shape, atol=0.0)
        inputs = cases.make_inputs(case, seed=1, xp=cupy)
        for _ in range(2):
            out = cupy_xattn.cross_attention_backward(**inputs, precision=args.precision)
        cupy.cuda.Device().synchronize()
        finite = all(bool(cupy.isfinite(o).all()) for o in out)
        print(f"{shape} {args.precision}: {'finite' if finite else 'NOT FINITE'}", flush=True)
        if not finite:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
