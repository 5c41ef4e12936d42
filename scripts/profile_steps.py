"""GPU time of each step of the backward (events between steps), for one shape and precision.

Usage: PYTHONPATH=. python3 scripts/profile_steps.py 64x128x77 tf32 [--reps 10]
The steps run back to back on the plan's stream, uncaptured, so small ones include a launch gap.
"""
import argparse

import numpy

import cupy_xattn
from cupy_xattn import cases


def main():
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape")
    parser.add_argument("precision")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    case = cases.parse_shape(args.shape, atol=0.0)
    inputs = cases.make_inputs(case, seed=0, xp=cupy)
    plan = cupy_xattn.plan(case.batch_size, case.num_video_tokens, case.num_text_tokens, precision=args.precision)
    out = plan(**inputs)
    (program, _), = plan._programs.values()
    program.bind(numpy.fromiter((a.data.ptr for a in (*inputs.values(), *out)), numpy.uint64), program.stream)
    times = {}
    for _ in range(args.reps):
        marks = [cupy.cuda.Event()]
        marks[0].record(program.stream)
        labels = []

        def between(label):
            marks.append(cupy.cuda.Event())
            marks[-1].record(program.stream)
            labels.append(label)

        program.run(between)
        marks[-1].synchronize()
        for i, label in enumerate(labels):
            times.setdefault((i, label), []).append(cupy.cuda.get_elapsed_time(marks[i], marks[i + 1]) * 1e3)
    total = 0.0
    for (i, label), t in times.items():
        median = float(numpy.median(t))
        total += median
        print(f"{i:3d} {label:32s} {median:9.1f} us")
    print(f"    {'sum':32s} {total:9.1f} us")


if __name__ == "__main__":
    main()
