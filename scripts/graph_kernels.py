"""One plan replay of a shape: its GPU time (CUDA events, warm L2, median) and, under ncu, the
duration of each kernel in the graph; the two together say how much of a small case is idle gaps.

Usage:  PYTHONPATH=. python3 scripts/graph_kernels.py 2x256x77 tf32            (time the replay)
        ncu --clock-control none --cache-control none --profile-from-start off \\
            --metrics gpu__time_duration.sum --csv \\
            python3 scripts/graph_kernels.py 2x256x77 tf32 --profile      (each kernel of one replay)
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
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="bracket one replay for ncu instead of timing")
    args = parser.parse_args()
    case = cases.parse_shape(args.shape, atol=0.0)
    inputs = cases.make_inputs(case, seed=0, xp=cupy)
    plan = cupy_xattn.plan(case.batch_size, case.num_video_tokens, case.num_text_tokens, precision=args.precision)
    out = plan(**inputs)
    for _ in range(3):
        plan(**inputs, out=out)
    cupy.cuda.Device().synchronize()
    if args.profile:
        cupy.cuda.profiler.start()
        plan(**inputs, out=out)
        cupy.cuda.Device().synchronize()
        cupy.cuda.profiler.stop()
        return
    single, queued = [], []
    for _ in range(args.reps):
        for calls, times in ((1, single), (10, queued)):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            cupy.cuda.Device().synchronize()
            start.record()
            for _ in range(calls):
                plan(**inputs, out=out)
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls)
    print(f"{args.shape} {args.precision}: one call {float(numpy.median(single)):.1f} us (idle GPU: the host time "
          f"before the launch counts), ten queued calls {float(numpy.median(queued)):.1f} us each (warm L2)")


if __name__ == "__main__":
    main()
