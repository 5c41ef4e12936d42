"""Host time of one backward call and of its parts, on a GPU machine (issue #6's figures).

Usage:  PYTHONPATH=. python3 scripts/host_probe.py [BxNvxNt] [--precision tf32] [--reps 300]

Two figures per path, in µs of perf_counter time:
  idle  the median of single calls each made with the GPU idle (the stream synchronized before
        it): the host time the first kernel waits for. The paths take turns call by call, so a
        host whose speed drifts (these lent machines do) biases none of them.
  b2b   the mean time per call of 20 calls issued back to back (the GPU busy behind them), the
        best of 15 such runs: a loop's throughput. Measured one path after the other, not in turn.
"""
import argparse
import statistics
import time

import cupy
import numpy

import cupy_xattn
from cupy_xattn import cases, checks
from cupy_xattn.grads import INPUT_NAMES

BATCH = 20


def idle_us(paths, reps):
    """Median µs of one call per path, the paths taking turns."""
    stream = cupy.cuda.get_current_stream()
    samples = [[] for _ in paths]
    for _ in range(reps):
        for times, (_, fn) in zip(samples, paths):
            stream.synchronize()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    stream.synchronize()
    return [1e6 * statistics.median(times) for times in samples]


def back_to_back_us(fn, runs):
    stream = cupy.cuda.get_current_stream()
    best = float("inf")
    for _ in range(runs):
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(BATCH):
            fn()
        best = min(best, (time.perf_counter() - start) / BATCH)
    stream.synchronize()
    return 1e6 * best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", default="2x256x77")
    parser.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "fp16"])
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    case = cases.parse_shape(args.shape, atol=0.0)
    inputs = cases.make_inputs(case, seed=0, xp=cupy)
    arrays = tuple(inputs[name] for name in INPUT_NAMES)
    plan = cupy_xattn.plan(case.batch_size, case.num_video_tokens, case.num_text_tokens, precision=args.precision)
    out = plan(**inputs)
    options = dict(scale=None, num_heads=16, precision=args.precision, backend="cupy")
    problem, addresses = checks.fast_validate(arrays, **options, out=out)
    (program, graph), = plan._programs.values()
    stream = cupy.cuda.get_current_stream()
    table = numpy.array(addresses, numpy.uint64)
    paths = [
        ("cross_attention_backward(..., out=out)",
         lambda: cupy_xattn.cross_attention_backward(**inputs, precision=args.precision, out=out)),
        ("cross_attention_backward(...)",
         lambda: cupy_xattn.cross_attention_backward(**inputs, precision=args.precision)),
        ("plan(..., out=out)", lambda: plan(**inputs, out=out)),
        ("plan(...)", lambda: plan(**inputs)),
        ("  checks.fast_validate (out given)", lambda: checks.fast_validate(arrays, **options, out=out)),
        ("  plan.launch (addresses given)", lambda: plan.launch(arrays, problem.scale, out, addresses)),
        ("    Backward.bind (pointer table copy)", lambda: program.bind(table, stream)),
        ("    graph.launch", lambda: graph.launch(stream)),
        ("cupy.cuda.runtime.getDevice", cupy.cuda.runtime.getDevice),
        ("cupy.cuda.get_current_stream", cupy.cuda.get_current_stream),
    ]
    for _, fn in paths:  # warm-up
        for _ in range(30):
            fn()
    idle = idle_us(paths, args.reps)
    print(f"{args.shape} {args.precision}: host µs per call (idle: median of {args.reps} single calls on an idle GPU, "
          f"paths in turn; b2b: best mean of {BATCH} calls back to back)")
    print(f"{'':42s} {'idle':>7s} {'b2b':>7s}")
    for (label, fn), t in zip(paths, idle):
        print(f"{label:42s} {t:7.1f} {back_to_back_us(fn, 15):7.1f}", flush=True)


if __name__ == "__main__":
    main()
