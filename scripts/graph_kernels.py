"""One plan replay of a shape: its GPU time (CUDA events, warm L2, median) and, under ncu, the
duration of each kernel in the graph; the two together say how much of a small case is idle gaps.

Usage:  PYTHONPATH=. python3 scripts/graph_kernels.py 2x256x77 tf32            (time the replay)
        PYTHONPATH=. python3 scripts/graph_kernels.py 2x256x77 tf32 --trace    (idle gaps per replay,
                                                     each after a lead spin, as the benchmark; --no-lead;
                                                     --kernels, --extremes: kernel lists)
        ncu --clock-control none --cache-control none --profile-from-start off \\
            --metrics gpu__time_duration.sum --csv \\
            python3 scripts/graph_kernels.py 2x256x77 tf32 --profile      (each kernel of one replay)
"""
import argparse
import json
import os
import tempfile
import time

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
    parser.add_argument("--trace", action="store_true",
                        help="every kernel's start and end in each replay (CUPTI, through torch.profiler)")
    parser.add_argument("--kernels", action="store_true", help="with --trace: list the kernels of the last replay")
    parser.add_argument("--extremes", action="store_true",
                        help="with --trace: list the kernels of the fastest and the slowest replay (by span)")
    parser.add_argument("--no-lead", action="store_true",
                        help="with --trace: no spin kernel before each replay (the GPU idle before it)")
    args = parser.parse_args()
    if (args.kernels or args.extremes) and not args.trace:
        parser.error("--kernels and --extremes list the kernels of a --trace run: give --trace too")
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
    if args.trace:
        trace(lambda: plan(**inputs, out=out), args.reps, args.kernels, lead=not args.no_lead, extremes=args.extremes)
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


def trace(call, reps, listing=False, lead=True, extremes=False):
    """Per replay: span from the first kernel's start to the last one's end, the time some kernel
    runs (union of the kernels' intervals), the sum of the kernels' durations; span - busy is the
    idle gaps. torch's profiler serves only as a CUPTI front end.
    With ``lead`` (as the benchmark times a call) each replay follows the spin kernel of
    bench.LEAD_CYCLES, left out of the figures, so the host has issued the whole replay before its
    first kernel starts; without it the GPU is idle before each replay, and the host's time to
    issue the replay can show as gaps (traces before Session 25 were taken that way).
    ``extremes`` lists the fastest and the slowest replay: where the spans split into two groups
    (the lanes' kernels taking the SMs in another order), the two listings show the orders."""
    import cupy
    import torch.profiler

    from cupy_xattn import bench

    spin = cupy.RawKernel(bench.LEAD_SOURCE, "lead") if lead else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            cupy.cuda.Device().synchronize()
            if lead:
                spin((1,), (1,), (numpy.int64(bench.LEAD_CYCLES),))
            call()
            cupy.cuda.Device().synchronize()
            time.sleep(0.002)  # replays at least 2 ms apart: a gap that long splits them below
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset") and e["name"] != "lead")
    print("\n".join(report(split_replays(kernels), listing, extremes)))


def split_replays(kernels):
    """The (start, end, name) kernels of a trace, sorted by start (µs), in replays: a gap of over
    1 ms after the latest end so far starts a new one."""
    replays, current, reach = [], [], 0.0  # reach: the latest end in the current replay so far
    for kernel in kernels:
        if current and kernel[0] - reach > 1000:
            replays.append(current)
            current = []
        reach = max(reach, kernel[1]) if current else kernel[1]
        current.append(kernel)
    replays.append(current)
    return replays


def report(replays, listing=False, extremes=False):
    """Lines: each replay's idle gaps and span, the medians, and the kernels of the last replay
    (``listing``) and of the fastest and slowest (``extremes``), times from the replay's start."""
    rows = []
    for replay in replays:
        busy, reach = 0.0, replay[0][0]
        for start, end, _ in replay:
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        span = reach - replay[0][0]
        total = sum(end - start for start, end, _ in replay)
        rows.append((span, busy, span - busy, 100 * (span - busy) / span, total, span / total, len(replay)))
    span, busy, gaps, share, total, ratio, count = (float(numpy.median(column)) for column in zip(*rows))
    lines = ["idle gaps per replay, us: " + " ".join(f"{row[2]:.1f}" for row in rows),
             "span per replay, us: " + " ".join(f"{row[0]:.1f}" for row in rows),
             f"{len(rows)} replays, medians of each figure: {count:.0f} kernels and memsets, span {span:.1f} us, "
             f"busy {busy:.1f} us, idle gaps {gaps:.1f} us ({share:.1f} % of the span), sum of durations "
             f"{total:.1f} us (span / sum {ratio:.2f})"]
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    listed = [("last", len(replays) - 1)] * listing + [("fastest", order[0]), ("slowest", order[-1])] * extremes
    for label, i in listed:
        origin = replays[i][0][0]
        lines.append(f"{label} replay, span {rows[i][0]:.1f} us:")
        lines += [f"  {start - origin:7.1f} {end - origin:7.1f} {end - start:6.1f}  {name[:100]}"
                  for start, end, name in replays[i]]
    return lines


if __name__ == "__main__":
    main()
