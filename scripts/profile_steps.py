"""GPU time of each step of the backward (events between steps), for one shape and precision.

Usage: PYTHONPATH=. python3 scripts/profile_steps.py 64x128x77 tf32 [--reps 10]
The steps run uncaptured, each on its lane (steps on side lanes overlap the main lane's), so
small ones include a launch gap; the last line is the whole run, first start to last end. Each
step's line gives its median duration and when it started (median, from the first step's start):
a timeline of the lanes, to see which step waits.
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
    times, starts, totals = {}, {}, []
    for _ in range(args.reps):
        marks = []

        def timer(label, stream, step):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            step()
            end.record(stream)
            marks.append((label, stream is program.stream, start, end))

        program.run(timer)
        marks[-1][3].synchronize()
        totals.append(cupy.cuda.get_elapsed_time(marks[0][2], marks[-1][3]) * 1e3)
        for i, (label, main, start, end) in enumerate(marks):
            times.setdefault((i, label, main), []).append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
            starts.setdefault(i, []).append(cupy.cuda.get_elapsed_time(marks[0][2], start) * 1e3)
    for (i, label, main), t in times.items():
        print(f"{i:3d} {label:32s} {float(numpy.median(t)):9.1f} us, from {float(numpy.median(starts[i])):7.1f} us"
              f"{'' if main else '   (side lane)'}")
    print(f"    {'first start to last end':32s} {float(numpy.median(totals)):9.1f} us")


if __name__ == "__main__":
    main()
