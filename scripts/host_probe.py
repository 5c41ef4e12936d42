"""Host time of one backward call and of its parts, on a GPU machine (issue #6's figures).

Usage:  PYTHONPATH=. python3 scripts/host_probe.py [BxNvxNt] [--precision tf32]

Each figure is the median perf_counter time of one call made with the GPU idle (the stream is
synchronized before each), over 300 calls after 30 warm-ups: the host time the benchmark's first
kernel waits for, not a throughput of back-to-back calls (those would queue behind the GPU).
"""
import argparse
import statistics
import time

import cupy
import numpy

import cupy_xattn
from cupy_xattn import cases, checks
from cupy_xattn.grads import INPUT_NAMES


def host_us(fn, reps=300, warmup=30):
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        stream.synchronize()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    stream.synchronize()
    return 1e6 * statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", default="2x256x77")
    parser.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "fp16"])
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
    parts = [
        ("cross_attention_backward(..., out=out)",
         lambda: cupy_xattn.cross_attention_backward(**inputs, precision=args.precision, out=out)),
        ("cross_attention_backward(...)",
         lambda: cupy_xattn.cross_attention_backward(**inputs, precision=args.precision)),
        ("plan(..., out=out)", lambda: plan(**inputs, out=out)),
        ("  checks.fast_validate (out given)", lambda: checks.fast_validate(arrays, **options, out=out)),
        ("  plan.launch (addresses given)", lambda: plan.launch(arrays, problem.scale, out, addresses)),
        ("    Backward.bind (pointer table copy)", lambda: program.bind(table, stream)),
        ("    graph.launch", lambda: graph.launch(stream)),
        ("cupy.cuda.runtime.getDevice", cupy.cuda.runtime.getDevice),
        ("cupy.cuda.get_current_stream", cupy.cuda.get_current_stream),
    ]
    print(f"{args.shape} {args.precision}: host µs per call (median of 300, idle GPU)")
    for label, fn in parts:
        print(f"{label:42s} {host_us(fn):7.1f}", flush=True)


if __name__ == "__main__":
    main()
