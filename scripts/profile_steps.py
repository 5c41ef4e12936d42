"""GPU time of each step of the backward, for one shape and precision: a timeline of the lanes.

Usage: PYTHONPATH=. python3 scripts/profile_steps.py 64x128x77 tf32 [--reps 10]
The steps are captured into a CUDA graph with a one-thread kernel before and after each, on the
step's lane, that stores the GPU's global timer (events recorded in a graph cannot be timed), and
the graph is replayed: the times are the GPU's as a plan replays it, not the host's issue rate
(issued one by one from Python, each step took ~40 µs of host time on the lent H200, longer than
most steps). Each mark adds a launch of ~2 µs to its lane. Each step's line gives its median
duration and when it started (from the first mark); steps on side lanes overlap the main lane's.
The last line is the whole replay, first mark to last.
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
    stamp = cupy.RawKernel(r'''
extern "C" __global__ void stamp(unsigned long long* at) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    *at = now;
}''', "stamp")
    clock = cupy.zeros(2 * len(program._steps), numpy.uint64)  # ns, a start and an end per step
    marks = []

    def timer(label, stream, step):
        i = 2 * len(marks)
        with stream:
            stamp((1,), (1,), (clock[i:],))
            step()
            stamp((1,), (1,), (clock[i + 1:],))
        marks.append((label, stream is program.stream))

    program.stream.begin_capture()
    try:
        program.run(timer)
    finally:
        graph = program.stream.end_capture()
    times, starts, totals = {}, {}, []
    for _ in range(args.reps):
        graph.launch(program.stream)
        program.stream.synchronize()
        ns = cupy.asnumpy(clock).astype(numpy.int64)
        totals.append((ns.max() - ns[0]) / 1e3)
        for i, (label, main) in enumerate(marks):
            times.setdefault((i, label, main), []).append((ns[2 * i + 1] - ns[2 * i]) / 1e3)
            starts.setdefault(i, []).append((ns[2 * i] - ns[0]) / 1e3)
    for (i, label, main), t in times.items():
        print(f"{i:3d} {label:32s} {float(numpy.median(t)):9.1f} us, from {float(numpy.median(starts[i])):7.1f} us"
              f"{'' if main else '   (side lane)'}")
    print(f"    {'first start to last end':32s} {float(numpy.median(totals)):9.1f} us")


if __name__ == "__main__":
    main()
